"""RL with media as a specification: image and speech to caption, caption to image and speech, ShapesWorld.

The engine lays image/speech prompts out as pretraining did (codes from the frozen tokenizers, t and the
group id continuing after the media), so in float32 its log-probs are the trainer's, its greedy
captions are those of `generate_text_after`, continuous batching and re-prefill after a sync change
nothing, and the rollouts survive a weights-only checkpoint. Images it draws by NFSP are those of
`generate_visual`, speech it says by NCP that of `generate_audio`, with the trainer's log-probs per code
(and END). `RLTask` trains on graded rewards from a batch mixing all the tasks. The model is tiny with
untrained tokenizers and a 60-step supervised caption warm start (about 10 s), enough for captions that
parse and get graded rewards.
"""

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from rl_fit_helpers import fit_logging_metrics

from zoo.datamodules.chat import chat_document
from zoo.datamodules.instructions import INSTRUCTIONS, ShapesInstructions
from zoo.datamodules.media_samples import MediaSpec
from zoo.datamodules.paired_documents import DocumentMaker
from zoo.datamodules.sequence import AudioSegment, MediaLayout, SequenceBuilder, TextSegment, VisualSegment
from zoo.datamodules.shapes_multimodal import ShapesMultimodalDataModule
from zoo.models.backbone import UnifiedTransformer
from zoo.models.media_generation import generate_audio, generate_text_after, generate_visual
from zoo.models.nfsp import flatten_scales
from zoo.models.unified import UnifiedModel
from zoo.rl.data_shapes import ShapesRLDataModule
from zoo.rl.hints import HintController, HintSchedule
from zoo.rl.records import Rollout
from zoo.rl.rollout import InferenceEngine, routing_agreement, sequence_logprobs
from zoo.rl.scoring import ScoringConfig
from zoo.rl.task import RLTask, RolloutConfig
from zoo.rl.update import OptimConfig, UpdateConfig
from zoo.rl.verifiers import verifier_for
from zoo.tokenizers.audio import AudioCodec
from zoo.tokenizers.visual import VisualTokenizer
from zoo.tokenizers.vocab import UnifiedVocab
from zoo.world.speech import SAMPLE_RATE

TASKS = ("image_to_text", "audio_to_text")


def make_model() -> UnifiedModel:
    torch.manual_seed(0)
    visual, codec = VisualTokenizer(), AudioCodec()
    vocab = UnifiedVocab(text_size=320, visual_size=visual.codebook_size, audio_size=256, audio_levels=4)
    backbone = UnifiedTransformer(
        dim=32, n_layers=2, n_heads=2, n_kv_heads=1, n_experts=4, expert_hidden=16, top_k=2, max_seq_len=160
    )
    return UnifiedModel(backbone, vocab, mtp_depth=0, visual_tokenizer=visual, audio_codec=codec)


def make_data(model: UnifiedModel, **overrides) -> ShapesRLDataModule:
    args = dict(
        tasks=TASKS, max_objects=1, train_size=64, heldout_size=8, tokenizer_size=300, steps_per_epoch=4,
        val_batch_size=8,
    )  # fmt: skip
    return ShapesRLDataModule(vocab=model.vocab, layout=MediaLayout.of(model), **{**args, **overrides})


@pytest.fixture(scope="module")
def warm() -> tuple[dict, str]:
    """Weights after 60 supervised steps on image/speech-to-caption documents, and the tokenizer."""
    model = make_model()
    data = make_data(model)
    data.setup()
    layout = MediaLayout.of(model)
    pretraining = ShapesMultimodalDataModule(
        vocab=model.vocab, layout=layout, caption_weight=0.0, text_to_image_weight=0.0,
        image_to_text_weight=1.0, audio_to_text_weight=1.0, max_objects=1,
    )  # fmt: skip
    pretraining.tokenizer = data.tokenizer
    docs = [pretraining.task_document(pretraining.task_of("train", i, 0), "train", i) for i in range(64)]
    builder = SequenceBuilder(model.vocab, 160, layout=layout)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(60):
        start = (step * 16) % len(docs)
        loss = model(builder.collate(docs[start : start + 16])).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}, data.tokenizer.to_json()


def warm_model(state: tuple[dict, str]) -> UnifiedModel:
    model = make_model()
    model.load_state_dict(state[0])
    return model.eval()


def warm_data(model: UnifiedModel, state: tuple[dict, str], **overrides) -> ShapesRLDataModule:
    from zoo.tokenizers.text import TextTokenizer

    data = make_data(model, **overrides)
    data.use_tokenizer(TextTokenizer.from_json(state[1]))
    return data


def max_gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True) if x.numel())


# --- the data ----------------------------------------------------------------------------------------


def test_caption_queries_are_seeded_disjoint_and_prompt_with_the_scenes_media(warm):
    model = warm_model(warm)
    data = warm_data(model, warm, train_size=32)
    train, heldout = data.train_queries(), data.heldout_queries()
    assert [q.id for q in train] == [q.id for q in make_data(model, train_size=32).train_queries()]
    assert not {q.id for q in train} & {q.id for q in heldout}
    assert {q.task for q in train} == {"image_caption", "speech_caption"}
    for q in train[:8]:
        document = data.base_prompt(q)
        assert document[0] == TextSegment([model.vocab.bos_id])
        media = document[1]
        if q.task == "image_caption":
            assert isinstance(media, VisualSegment) and not media.predict
            assert media.pixels.shape == (3, 32, 32)
        else:
            assert isinstance(media, AudioSegment) and media.wave.dim() == 1 and not media.predict
        assert q.answer == q.solution and q.difficulty == 1
        assert verifier_for(q.task)(q, q.answer) == 1.0 > verifier_for(q.task)(q, "a cat")
    with pytest.raises(TypeError, match="base_prompt"):
        data.base_prompt_ids(train[0])
    with pytest.raises(ValueError, match="tasks must be among"):
        make_data(model, tasks=("text_to_smell",))
    with pytest.raises(ValueError, match="heldout_split"):
        make_data(model, heldout_split="train")


def test_a_chat_model_is_prompted_as_sft_taught_it(warm):
    """With role tokens, each task's prompt is the user's turn of SFT's ShapesInstructions conversation
    for the same scene (in the first phrasing), then `<|assistant|>`; a drawing or speaking prompt then
    opens the medium, as SFT's answer does."""
    model = warm_model(warm)
    vocab = replace(model.vocab, chat=True)
    tasks = ("image_to_text", "audio_to_text", "text_to_image", "text_to_audio")
    data = ShapesRLDataModule(
        tasks=tasks, vocab=vocab, layout=MediaLayout.of(model), max_objects=1, heldout_size=64,
        tokenizer_size=300,
    )  # fmt: skip
    data.setup()
    maker = DocumentMaker(vocab, data.tokenizer, MediaLayout.of(model), 4096)
    spec = MediaSpec(image_size=32, sample_rate=SAMPLE_RATE)
    assistant = TextSegment([vocab.special("<|assistant|>")], predict=False)
    for task, name in zip(tasks, ("describe_image", "describe_speech", "draw", "say"), strict=True):
        sft = ShapesInstructions(**{n: float(n == name) for n in INSTRUCTIONS}, max_objects=1)
        query = next(  # a held-out scene SFT asks about in the first phrasing
            q for q in data.heldout_queries() if q.id.startswith(task)
            and sft.task_of("val", int(q.id.split("/")[2]), 0)[1] == INSTRUCTIONS[name][0]
        )  # fmt: skip
        turns = sft.conversation("val", int(query.id.split("/")[2]), 0, spec)
        taught = chat_document(maker, turns, answers_predicted=True)
        prompt = data.base_prompt(query)
        if task.startswith("text_to"):
            assert prompt[-1] == vocab.special("<boi>" if task == "text_to_image" else "<boa>")
            assert prompt[:-1] == [i for segment in taught[:4] for i in segment.ids]
            assert taught[3] == assistant and taught[4].predict and taught[4].predict_opener
            continue
        assert len(prompt) == 5 and prompt[-1] == assistant
        for ours, theirs in zip(prompt, taught, strict=False):
            assert type(ours) is type(theirs) and not ours.predict
            if isinstance(ours, TextSegment):
                assert ours.ids == theirs.ids
            elif isinstance(ours, VisualSegment):
                assert torch.equal(ours.pixels, theirs.pixels)  # the same scene (speech: another voice)
        assert data.decode(taught[5].ids) == query.answer
    with pytest.raises(ValueError, match="no video conversations"):
        ShapesRLDataModule(tasks=("video_to_text",), vocab=vocab)


def test_an_ahrl_hint_follows_the_media_as_text(warm):
    model = warm_model(warm)
    data = warm_data(model, warm)
    data.hints = HintController(HintSchedule(p_init=0.5))
    query = data.train_queries()[0]
    data.hints.set_pass_init(query.id, 0.0)
    prompt = data.encode_prompt(query)
    assert prompt[:2] == data.base_prompt(query) and isinstance(prompt[-1], TextSegment)
    hint = prompt[-1].ids
    assert 0 < len(hint) and data.decode(hint) and query.solution.startswith(data.decode(hint))


# --- the engine and the trainer ----------------------------------------------------------------------


def test_engine_logprobs_and_routing_are_the_trainers_on_a_batch_mixing_image_speech_and_text(warm):
    model = warm_model(warm)
    data = warm_data(model, warm)
    queries = data.next_queries(4)
    prompts = [data.encode_prompt(q) for q in queries] + [[model.vocab.bos_id, model.vocab.text_offset + 5]]
    engine = InferenceEngine(model, max_new_tokens=6, stop_ids=(), seed=3)
    rollouts = engine.generate(prompts, [*queries, queries[0]])
    builder = SequenceBuilder(model.vocab, 160, layout=MediaLayout.of(model))
    for q, r in zip(queries, rollouts, strict=False):
        assert len(r.response_ids) == 6 and r.inf_logprobs.shape == (6,)
        media = r.prompt_document[1]
        assert media.codes is not None  # tokenized once, at start: engine and trainer embed the same codes
        assert len(r.prompt_ids) == builder.length(data.base_prompt(q))
        opener = "<boi>" if q.task == "image_caption" else "<boa>"
        assert r.prompt_ids[1] == model.vocab.special(opener)
        for chosen in r.routing.values():
            assert chosen.shape == (len(r.prompt_ids) + 6, 2)
    assert rollouts[-1].prompt_document is None
    inf = [r.inf_logprobs for r in rollouts]
    with torch.no_grad():
        assert max_gap(sequence_logprobs(model, rollouts, replay=False), inf) < 1e-4
        assert max_gap(sequence_logprobs(model, rollouts, replay=True), inf) < 1e-4
    assert routing_agreement(model, rollouts) == 1.0


def test_greedy_engine_captions_equal_generate_text_after_alone_batched_and_across_a_sync(warm):
    model = warm_model(warm)
    data = warm_data(model, warm)
    queries = data.next_queries(4)
    documents = [data.base_prompt(q) for q in queries]
    builder = SequenceBuilder(model.vocab, 160, layout=MediaLayout.of(model))
    reference = generate_text_after(model, builder.collate_prompts(documents), 12, temperature=0.0)

    def engine() -> InferenceEngine:
        return InferenceEngine(model, max_new_tokens=12, temperature=0.0, max_batch=2)

    # max_batch=2: rows join as others leave (continuous batching), and each alone.
    batched = [r.response_ids for r in engine().generate(documents, queries)]
    alone = [engine().generate([d], [q])[0].response_ids for d, q in zip(documents, queries, strict=True)]
    # Interrupted after 3 tokens and re-prefilled (prompt + partial response) under synced weights.
    resumed = engine()
    started = resumed.start(documents, queries)
    resumed.step(3)
    resumed.sync(model, version=1)
    while resumed.pending:
        resumed.step(8)
    assert batched == alone == [r.response_ids for r in started] == reference


def test_media_rollouts_round_trip_through_a_weights_only_checkpoint(warm, tmp_path: Path):
    model = warm_model(warm)
    data = warm_data(model, warm)
    queries = data.next_queries(2)
    engine = InferenceEngine(model, max_new_tokens=10, temperature=0.0)
    engine.start([data.encode_prompt(q) for q in queries], queries)
    engine.step(4)
    partial = engine.interrupt()
    torch.save([r.to_state() for r in partial], tmp_path / "state.pt")
    restored = [Rollout.from_state(s) for s in torch.load(tmp_path / "state.pt", weights_only=True)]
    for a, b in zip(partial, restored, strict=True):
        assert a.prompt_ids == b.prompt_ids and a.response_ids == b.response_ids
        assert torch.equal(a.prompt_document[1].codes, b.prompt_document[1].codes)
    fresh = InferenceEngine(model, max_new_tokens=10, temperature=0.0)
    fresh.resume(restored)
    while fresh.pending:
        fresh.step(8)
    uninterrupted = InferenceEngine(model, max_new_tokens=10, temperature=0.0)
    expected = uninterrupted.generate([data.encode_prompt(q) for q in queries], queries)
    assert [r.response_ids for r in restored] == [r.response_ids for r in expected]


def test_images_drawn_by_the_engine_are_generate_visuals_with_the_trainers_logprobs_per_code(warm):
    model = warm_model(warm)
    data = warm_data(model, warm, tasks=("text_to_image", "image_to_text"))
    queries = [q for q in data.next_queries(4) if q.task == "caption_to_image"]
    prompts = [data.encode_prompt(q) for q in queries]
    assert all(p[-1] == model.vocab.special("<boi>") for p in prompts)
    greedy = InferenceEngine(model, max_new_tokens=4, temperature=0.0).generate(prompts, queries)
    reference = flatten_scales(generate_visual(model, prompts, temperature=0.0)) + model.vocab.visual_offset
    assert [r.response_ids for r in greedy] == reference.tolist()  # whole images, whatever max_new_tokens
    engine = InferenceEngine(model, max_new_tokens=4, seed=1)
    mixed = engine.generate([*prompts, data.encode_prompt(data.next_queries(1)[0])], [*queries, queries[0]])
    images, caption = mixed[:-1], mixed[-1]
    assert len(caption.response_ids) <= 4
    assert all(t not in model.vocab.visual_range() for t in caption.response_ids)
    for r in images:
        assert r.finished and len(r.response_ids) == model.nfsp.tokens_per_frame == len(r.inf_logprobs)
        assert all(t in model.vocab.visual_range() for t in r.response_ids)
        for chosen in r.routing.values():
            assert chosen.shape == (len(r.prompt_ids) + len(r.response_ids), 2)
    with torch.no_grad():
        logprobs, entropy = sequence_logprobs(model, mixed, replay=True, with_entropy=True)
    assert max_gap(logprobs, [r.inf_logprobs for r in mixed]) < 1e-4
    assert entropy[0].shape == (model.nfsp.tokens_per_frame,) and float(entropy[0].max()) > 0
    assert routing_agreement(model, mixed) == 1.0


def test_speech_said_by_the_engine_is_generate_audios_with_the_trainers_logprobs_per_level_and_end(warm):
    model = warm_model(warm)
    data = warm_data(model, warm, tasks=("text_to_audio",))
    queries = data.next_queries(3)
    prompts = [data.encode_prompt(q) for q in queries]
    assert all(p[-1] == model.vocab.special("<boa>") for p in prompts)
    engine = InferenceEngine(model, max_new_tokens=2, temperature=0.0, max_audio_frames=12)
    greedy = engine.generate(prompts, queries)
    reference = generate_audio(model, prompts, max_frames=12, temperature=0.0)
    levels, eoa = model.ncp.levels, model.vocab.special("<eoa>")
    for r, codes in zip(greedy, reference, strict=True):
        ended = r.response_ids[-1] == eoa
        assert r.finished == ended and r.truncated == (not ended) and len(codes) <= 12
        assert len(r.response_ids) == len(codes) * levels + ended == len(r.inf_logprobs)
        frames = torch.tensor(r.response_ids[: len(r.response_ids) - ended]).view(-1, levels)
        offsets = model.vocab.audio_offset + torch.arange(levels) * model.vocab.audio_size
        assert torch.equal(frames - offsets, codes)
        for chosen in r.routing.values():
            assert chosen.shape == (len(r.prompt_ids) + len(codes), 2)  # one position a frame
    sampled = InferenceEngine(model, max_new_tokens=2, max_audio_frames=6, seed=2).generate(prompts, queries)
    assert all(len(r.response_ids) <= 6 * levels + 1 for r in sampled)
    with torch.no_grad():
        logprobs, entropy = sequence_logprobs(model, greedy + sampled, replay=True, with_entropy=True)
    assert max_gap(logprobs, [r.inf_logprobs for r in greedy + sampled]) < 1e-4
    assert all(e.shape == lp.shape and bool((e >= 0).all()) for e, lp in zip(entropy, logprobs, strict=True))
    assert routing_agreement(model, greedy + sampled) == 1.0


@pytest.mark.parametrize("precision", ["bfloat16", "fp8"])
def test_a_low_precision_engine_reads_media_prompts_and_draws_images_with_a_small_mismatch(warm, precision):
    model = warm_model(warm)
    data = warm_data(model, warm, tasks=("image_to_text", "audio_to_text", "text_to_image"))
    queries = data.next_queries(6)
    engine = InferenceEngine(model, precision=precision, max_new_tokens=5, stop_ids=())
    assert next(engine.model.visual_tokenizer.parameters()).dtype == torch.float32  # frozen: not cast
    rollouts = engine.generate([data.encode_prompt(q) for q in queries], queries)
    assert sorted({len(r.response_ids) for r in rollouts}) == [5, model.nfsp.tokens_per_frame]
    with torch.no_grad():
        gap = max_gap(sequence_logprobs(model, rollouts, replay=True), [r.inf_logprobs for r in rollouts])
    assert 1e-5 < gap < 0.5  # a real mismatch, but the same prompts (codes) on both sides


# --- RLTask ------------------------------------------------------------------------------------------


def test_rl_steps_on_captions_and_images_train_and_validate_per_task(warm, tmp_path: Path):
    model = warm_model(warm).train()
    data = warm_data(model, warm, tasks=("image_to_text", "audio_to_text", "text_to_image", "text_to_audio"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rollout = RolloutConfig(max_new_tokens=24, max_audio_frames=16)
    task = RLTask(
        model, rollout=rollout, update=UpdateConfig(batch_size=4, group_size=4), optim=OptimConfig(lr=1e-3),
        scoring=ScoringConfig(val_max_new_tokens=24),
    )  # fmt: skip
    trainer, logged = fit_logging_metrics(task, data, tmp_path)
    trained = sum(step["train/trained_samples"] for step in logged)
    assert trained > 0, "no group had graded rewards that differ: the warm start is too weak"
    assert 0.0 < max(step["train/reward"] for step in logged) <= 1.0
    moved = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert any(k.startswith("backbone.") for k in moved)
    assert not any(k.startswith(("nfsp.tokenizer.", "ncp.codec.")) for k in moved)  # frozen tokenizers
    metrics = trainer.callback_metrics
    names = ("val/reward", "val/image_caption/reward", "val/speech_caption/reward_sampled")
    for name in (*names, "val/caption_to_image/reward", "val/caption_to_speech/reward_sampled"):
        assert 0.0 <= float(metrics[name]) <= 1.0
