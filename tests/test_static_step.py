"""The static-shape text decode step and its compiled form (issue 15, "Speed"): the same greedy tokens as the
dynamic cached step and as recomputation, the pinned text generations unchanged, and one graph without
breaks for `torch.compile`."""

import json
import sys
from pathlib import Path

import pytest
import torch

from zoo.models import static_step
from zoo.models.decode import Cursor, Recording, text_prompts, text_step
from zoo.models.elastic import ElasticConfig
from zoo.models.generation import collect, stream_text
from zoo.models.kv_cache import KVCache
from zoo.models.sampling import Sampler
from zoo.registry import create_model

sys.path.insert(0, str(Path(__file__).parent / "golden"))
from make_generations import GENERATIONS, TEXT_PROMPTS, seeded, text_model  # noqa: E402

PROMPTS = [[1, 20, 21, 22, 23, 24, 25], [1, 30], [1, 40, 41, 42]]


def small_model():
    torch.manual_seed(0)
    shape = dict(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, n_experts=4, expert_hidden=16, top_k=2)
    return create_model("tiny", **shape, max_seq_len=128).eval()


def greedy(model, prompts, step="dynamic", use_cache=True, **kwargs):
    return model.generate(prompts, 20, temperature=0.0, stop_ids=(), use_cache=use_cache, step=step, **kwargs)


def test_a_static_step_writes_its_ids_and_keys_at_a_tensor_column_and_returns_the_whole_width():
    cache = KVCache(1, 2, 1, 6, 2)
    start = cache.reserve(2)
    assert start == 0 and cache.length == 2 and cache.all_doc_id.shape == (2, 6)
    columns = torch.tensor([0, 1])
    cache.write_ids(columns, torch.zeros(2, 2, dtype=torch.long), torch.tensor([[0, 1], [0, 1]]))
    k, v = cache.store(0, torch.tensor(0), torch.ones(2, 1, 2, 2), -torch.ones(2, 1, 2, 2))
    assert k.shape == v.shape == (2, 1, 6, 2)
    assert k[:, 0, :, 0].tolist() == [[1, 1, 0, 0, 0, 0]] * 2 and cache.group_id.tolist() == [[0, 1]] * 2
    with pytest.raises(ValueError, match="cache holds 6 positions; 2 used \\+ 5 new = 7"):
        cache.reserve(5)


def test_static_cache_widths_round_up_to_shared_buckets():
    assert [static_step.static_cache_len(n) for n in (1, 64, 65, 128)] == [64, 64, 128, 128]


@pytest.mark.parametrize("rows", [1, 3])
def test_the_static_step_gives_the_greedy_tokens_of_the_dynamic_step_and_of_recomputation(rows):
    model = small_model()
    prompts = PROMPTS[:rows]
    static = greedy(model, prompts, step="static")
    assert static == greedy(model, prompts) == greedy(model, prompts, use_cache=False)
    elastic = ElasticConfig(layers=(1,), top_k=1)
    assert greedy(model, prompts, step="static", elastic=elastic) == greedy(model, prompts, elastic=elastic)


def test_the_static_step_logits_equal_the_dynamic_ones_to_rounding():
    model = small_model()
    batch = text_prompts(model, PROMPTS)
    dynamic_cache, static_cache = (model.backbone.new_cache(3, n) for n in (batch.seq_len + 4, 64))
    with torch.no_grad():
        model.forward_hidden(batch, cache=dynamic_cache)
        model.forward_hidden(batch, cache=static_cache)
        step = static_step.StaticTextStep(model, static_cache)
        cursor = Cursor.after(batch)
        for ids in ([[5], [6], [7]], [[8, 9], [10, 11], [12, 13]]):
            ids = torch.tensor(ids)
            static_logits, routing = step(ids, cursor)
            out, _ = text_step(model, dynamic_cache, ids, cursor)
            assert torch.allclose(static_logits, model.sampling_logits(out.hidden), atol=1e-5)
            assert routing[1].tolist() == out.routing[1].tolist()
            cursor = cursor.advance(ids.shape[1])
    assert static_cache.length == dynamic_cache.length
    assert torch.equal(static_cache.doc_id, dynamic_cache.doc_id)
    assert torch.equal(static_cache.group_id, dynamic_cache.group_id)


def test_a_recording_of_the_static_step_holds_what_the_dynamic_step_records():
    model = small_model()
    recordings = []
    for step in ("dynamic", "static"):
        recording = Recording(3)
        sampler = Sampler(temperature=0.7, generator=torch.Generator().manual_seed(0))
        prompt = text_prompts(model, PROMPTS)
        stream = stream_text(model, prompt, 5, sampler, (), recording=recording, step=step)
        recordings.append((collect(stream, 3), recording))
    (tokens, dynamic), (static_tokens, static) = recordings
    assert tokens == static_tokens
    for row in range(3):
        assert static.logprobs[row] == pytest.approx(dynamic.logprobs[row], abs=1e-5)
        assert static.routing(row)[1].tolist() == dynamic.routing(row)[1].tolist()


def test_the_static_step_needs_the_cache_and_a_known_kind():
    model = small_model()
    with pytest.raises(ValueError, match="needs use_cache=True"):
        greedy(model, PROMPTS, step="static", use_cache=False)
    with pytest.raises(ValueError, match="expected 'dynamic', 'static' or 'compiled'"):
        greedy(model, PROMPTS, step="fast")


def test_the_pinned_text_generations_are_what_the_static_step_generates():
    expected = json.loads(GENERATIONS.read_text())["text"]
    model = text_model()
    assert model.generate(TEXT_PROMPTS, 16, temperature=0.0, stop_ids=(), step="static") == expected["greedy"]
    assert model.generate(TEXT_PROMPTS, 16, temperature=0.0, step="static") == expected["greedy_stop"]
    elastic = ElasticConfig(layers=(0, 2), top_k=1)
    got = model.generate(TEXT_PROMPTS, 12, temperature=0.0, stop_ids=(), elastic=elastic, step="static")
    assert got == expected["elastic"]
    got = model.generate(TEXT_PROMPTS, 16, 1.0, top_k=20, stop_ids=(), generator=seeded(7), step="static")
    assert got == expected["sampled_top_k"]


def test_the_static_step_traces_as_one_graph_without_breaks():
    model = small_model()
    batch = text_prompts(model, PROMPTS)
    cache = model.backbone.new_cache(3, 64)
    with torch.no_grad():
        model.forward_hidden(batch, cache=cache)
        cursor = Cursor.after(batch)
        at = torch.tensor(cache.reserve(1))
        ids = torch.tensor([[5], [6], [7]])
        explained = torch._dynamo.explain(static_step._text_step)(
            model, cache, None, ids, cursor.t, cursor.group, at
        )
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons


@pytest.mark.slow
@pytest.mark.parametrize("rows", [1, 3])
def test_the_compiled_step_gives_the_greedy_tokens_of_the_dynamic_step_and_compiles_once(rows):
    torch._dynamo.reset()
    model = small_model()
    prompts = PROMPTS[:rows]
    assert greedy(model, prompts, step="compiled") == greedy(model, prompts)
    frames = torch._dynamo.utils.counters["frames"]["ok"]
    assert frames >= 1  # the step was traced
    # Another prompt of a length in the same cache bucket: no new trace.
    shorter = [p[:-1] or p for p in prompts]
    assert greedy(model, shorter, step="compiled") == greedy(model, shorter)
    assert torch._dynamo.utils.counters["frames"]["ok"] == frames
