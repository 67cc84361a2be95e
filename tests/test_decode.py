"""The decoding core as a specification (issue 15): the KV cache's operations, the sampler, the decode
steps and the loops over them."""

import pytest
import torch

from zoo.batch import PAD_DOC, scale_coordinates
from zoo.models.decode import Recording, text_prompts
from zoo.models.generation import collect, stream_text
from zoo.models.kv_cache import KVCache
from zoo.models.sampling import Sampler, entropy, log_probs
from zoo.registry import create_model


def filled(rows: int, length: int, pad: list[int], fill: float) -> KVCache:
    """A one-layer cache whose row r has `pad[r]` padding columns on its left, keys and values = `fill`."""
    cache = KVCache(1, rows, 1, length + 2, 2)
    doc = torch.tensor([[PAD_DOC] * p + [0] * (length - p) for p in pad])
    start = cache.extend(doc, torch.arange(length).expand(rows, -1))
    cache.store(0, start, torch.full((rows, 1, length, 2), fill), torch.full((rows, 1, length, 2), -fill))
    return cache


def cached(cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0's keys and values `[R, length]` (first channel): storing nothing returns what is there."""
    empty = torch.zeros(cache.rows, 1, 0, 2)
    k, v = cache.store(0, cache.length, empty, empty)
    return k[:, 0, :, 0], v[:, 0, :, 0]


def test_a_forward_extends_the_cache_and_each_layer_stores_where_its_positions_go():
    cache = KVCache(2, 1, 1, 4, 2)
    assert cache.extend(torch.zeros(1, 3, dtype=torch.long), torch.arange(3)[None]) == 0
    k, v = cache.store(1, 0, torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2))
    assert cache.length == 3 and k.shape == (1, 1, 3, 2) and cache.doc_id.shape == (1, 3)
    with pytest.raises(ValueError, match="cache holds 4 positions; 3 used \\+ 2 new = 5"):
        cache.extend(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long))
    cache.truncate(1)
    assert cache.length == 1 and cache.group_id.tolist() == [[0]]
    with pytest.raises(ValueError, match="cannot truncate a cache of length 1 to 2"):
        cache.truncate(2)


def test_joined_rows_are_right_aligned_and_selecting_rows_drops_the_columns_no_row_uses():
    short, long = filled(1, 2, [0], 1.0), filled(2, 5, [0, 3], 2.0)
    joined = KVCache.join([short, long], headroom=4)
    assert joined.rows == 3 and joined.length == 5 and joined.max_len == 9
    assert joined.doc_id.tolist() == [[PAD_DOC] * 3 + [0] * 2, [0] * 5, [PAD_DOC] * 3 + [0] * 2]
    k, _ = cached(joined)
    assert k.tolist() == [[0, 0, 0, 1, 1], [2] * 5, [2] * 5]  # what the padding columns hold is masked
    joined.select([2, 0])  # the long row leaves: three columns are padding in both rows that stay
    assert joined.rows == 2 and joined.length == 2 and joined.doc_id.tolist() == [[0, 0], [0, 0]]
    k, v = cached(joined)
    assert k.tolist() == [[2, 2], [1, 1]] and v.tolist() == [[-2, -2], [-1, -1]]
    joined.grow(3)
    assert joined.max_len == 9 - 3 + 3 and joined.length == 2


def test_cache_operations_refuse_what_they_cannot_do():
    cache = filled(2, 3, [0, 0], 1.0)
    with pytest.raises(ValueError, match="at least one row"):
        cache.select([])
    with pytest.raises(ValueError, match="extra >= 1"):
        cache.grow(0)
    with pytest.raises(ValueError, match="at least one cache"):
        KVCache.join([])


def test_the_sampler_is_greedy_at_temperature_zero_and_scores_tokens_before_filtering():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 0.0]])
    assert Sampler(temperature=0.0).sample(logits).tolist() == [1, 0]
    drawn = Sampler(temperature=1.0, top_k=1, generator=torch.Generator().manual_seed(0)).sample(logits)
    assert drawn.tolist() == [1, 0]  # top-1 leaves only the argmax
    sampler = Sampler(temperature=0.5, top_p=0.5)
    expected = (logits / 0.5).log_softmax(-1)[[0, 1], [2, 3]]  # the unfiltered tempered distribution
    assert torch.allclose(sampler.logprob(logits, torch.tensor([2, 3])), expected)
    assert torch.equal(Sampler(temperature=0.0).log_probs(logits), logits.log_softmax(-1))  # scored at T=1


def test_entropy_counts_masked_ids_as_zero_and_bad_settings_are_refused():
    logp = log_probs(torch.tensor([[0.0, 0.0, -torch.inf]]))
    assert torch.allclose(entropy(logp), torch.tensor([torch.log(torch.tensor(2.0))]))
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        Sampler(temperature=-1.0)
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        Sampler(top_k=0)
    with pytest.raises(ValueError, match=r"top_p must lie in \(0, 1\]"):
        Sampler(top_p=1.5)


def tiny_text_model():
    torch.manual_seed(0)
    shape = dict(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, n_experts=4, expert_hidden=16, top_k=2)
    return create_model("tiny", **shape, max_seq_len=64).eval()


def test_every_scale_sits_at_the_centres_of_its_cells_on_the_finest_grid():
    assert [scale_coordinates(side, 8) for side in (1, 2, 4)] == [[4], [2, 6], [1, 3, 5, 7]]
    assert scale_coordinates(8, 8) == list(range(8))


def test_the_token_stream_is_what_generation_collects_and_ends_when_every_row_has_stopped():
    model = tiny_text_model()
    prompts = [[1, 20, 21], [1, 30]]
    greedy = model.generate(prompts, 6, temperature=0.0, stop_ids=())
    stop = (greedy[0][1],)  # row 0 samples it at step 1
    steps = list(stream_text(model, text_prompts(model, prompts), 6, Sampler(0.0), stop))
    ids, live = [t.tolist() for t, _ in steps], [rows.tolist() for _, rows in steps]
    assert ids == [list(column) for column in zip(*greedy, strict=True)][: len(steps)]
    assert live[0] == live[1] == [True, True] and not any(rows[0] for rows in live[2:])
    assert model.generate(prompts, 6, temperature=0.0, stop_ids=stop)[0] == greedy[0][:2]


def test_a_recording_holds_the_logprob_of_every_sampled_token_and_the_routing_of_every_position_fed():
    model = tiny_text_model()
    prompts = [[1, 20, 21, 22], [1, 30]]
    recording = Recording(2)
    sampler = Sampler(temperature=0.7, generator=torch.Generator().manual_seed(0))
    tokens = collect(stream_text(model, text_prompts(model, prompts), 5, sampler, (), recording=recording), 2)
    for row, (prompt, response) in enumerate(zip(prompts, tokens, strict=True)):
        batch = text_prompts(model, [prompt + response])
        logits = model.sampling_logits(model.forward_hidden(batch).hidden[0])
        teacher = log_probs(logits[len(prompt) - 1 : -1], 0.7)[range(len(response)), response]
        assert torch.allclose(torch.tensor(recording.logprobs[row]), teacher, atol=1e-5)
        # Every position fed: the prompt, and every response token but the last (never fed).
        routing = recording.routing(row)
        assert sorted(routing) == [1] and routing[1].shape == (len(prompt) + len(response) - 1, 2)
