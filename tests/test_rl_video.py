"""Video responses in RL as a specification (issue 18, item 5): a prompt ending with `<bov>` to a model whose
visual tokenizer is the causal 3D one asks for a video; the engine draws it whole by NFSP over latent frames
(the clips of `generate_visual`), the trainer lays it out as pretraining lays a clip and scores every code
as the engine did, the verifier reads the decoded frames (`verify_shapes_video`, motion included), and
those rewards train an RL step on ShapesWorld's `text_to_video`.

The model is tiny and random (a 4-layer-deep 8-channel causal 3D tokenizer with scales 1, 2, 4: 21 codes a
latent frame; 5 frames at temporal stride 2 are 3 latent frames, 63 codes): its clips are noise, whose
rewards are graded (the verifier reads some colour or cell right by chance), enough for GRPO groups whose
rewards differ.
"""

from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
import yaml
from rl_fit_helpers import fit_logging_metrics

from zoo.batch import Modality
from zoo.datamodules.sequence import MediaLayout, SequenceBuilder, TextSegment, VisualSegment
from zoo.models.backbone import UnifiedTransformer
from zoo.models.media_generation import generate_visual
from zoo.models.nfsp import flatten_scales
from zoo.models.unified import UnifiedModel
from zoo.rl.data_shapes import ShapesRLDataModule
from zoo.rl.losses import MismatchBounds, PolicyLossConfig
from zoo.rl.prompts import PromptLayout
from zoo.rl.records import Query, Rollout
from zoo.rl.responses import (
    ImageResponse,
    MediaLengths,
    TextResponse,
    VideoResponse,
    response_kind,
    rollout_batch,
)
from zoo.rl.rollout import InferenceEngine, routing_agreement, sequence_logprobs
from zoo.rl.scoring import Scorer, ScoringConfig, respond
from zoo.rl.task import RLTask, RolloutConfig
from zoo.rl.update import OptimConfig, PolicyUpdate, UpdateConfig
from zoo.rl.verifiers import verifier_for, verify_shapes_video
from zoo.tokenizers.visual import VisualTokenizer
from zoo.tokenizers.visual_quantizer import MultiScaleQuantizer
from zoo.tokenizers.vocab import UnifiedVocab
from zoo.world.render import render_video, to_tensor
from zoo.world.scenes import Scene, ShapeObject, caption

CODES = 3 * 21  # 3 latent frames of 1 + 4 + 16 codes


def make_model(temporal: bool = True) -> UnifiedModel:
    torch.manual_seed(0)
    quantizer = MultiScaleQuantizer(dim=8, codebook_size=64, scales=(1, 2, 4))
    visual = VisualTokenizer(
        image_size=32, channels=(8, 8, 8, 8), quantizer=quantizer, temporal=temporal,
        temporal_stride=2 if temporal else 1,
    )  # fmt: skip
    vocab = UnifiedVocab(text_size=320, visual_size=64, audio_size=16, audio_levels=1)
    backbone = UnifiedTransformer(
        dim=32, n_layers=2, n_heads=2, n_kv_heads=1, n_experts=4, expert_hidden=16, top_k=2, max_seq_len=128
    )
    return UnifiedModel(backbone, vocab, mtp_depth=0, visual_tokenizer=visual).eval()


def make_data(model: UnifiedModel, **overrides) -> ShapesRLDataModule:
    args = dict(
        tasks=("text_to_video",), max_objects=1, train_size=16, heldout_size=4, tokenizer_size=300,
        steps_per_epoch=4, val_batch_size=4,
    )  # fmt: skip
    data = ShapesRLDataModule(vocab=model.vocab, layout=MediaLayout.of(model), **{**args, **overrides})
    data.setup()
    return data


@pytest.fixture(scope="module")
def model() -> UnifiedModel:
    return make_model()


@pytest.fixture(scope="module")
def data(model) -> ShapesRLDataModule:
    return make_data(model)


def max_gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x.detach() - y).abs().max()) for x, y in zip(a, b, strict=True) if x.numel())


# --- the kind ----------------------------------------------------------------------------------------


def test_a_bov_prompt_asks_a_causal_3d_model_for_a_whole_video_of_the_lengths_frames(model):
    vocab = model.vocab
    bov, boi = vocab.special("<bov>"), vocab.special("<boi>")
    assert isinstance(response_kind(model, [vocab.bos_id, 20, bov]), VideoResponse)
    assert type(response_kind(model, [vocab.bos_id, 20, boi])) is ImageResponse  # one latent frame
    flat = make_model(temporal=False)  # a 2D tokenizer draws no video: the prompt is continued as text
    assert isinstance(response_kind(flat, [vocab.bos_id, 20, bov]), TextResponse)
    video, five, nine = VideoResponse(), MediaLengths(video_frames=5), MediaLengths(video_frames=9)
    assert video.budget(model, tokens=4, lengths=five, room=CODES) == CODES  # whatever the token budget
    assert video.budget(model, tokens=4, lengths=five, room=CODES - 1) == 0  # whole or nothing
    assert video.budget(model, tokens=4, lengths=nine, room=200) == 5 * 21
    assert MediaLengths.of(model, 8, None).video_frames == 3  # 1 + temporal_stride: two latent frames
    with pytest.raises(ValueError, match="does not fit temporal_stride 2"):
        MediaLengths.of(model, 8, 4)
    with pytest.raises(ValueError, match="does not fit temporal_stride 2"):
        InferenceEngine(model, video_frames=6)


def test_text_to_video_queries_caption_a_moving_scene_and_prompt_for_a_clip(model, data):
    queries = data.train_queries()
    assert {q.task for q in queries} == {"caption_to_video"}
    assert any("moving" in q.answer for q in queries), "the clips of text_to_video should move"
    for q in queries[:4]:
        prompt = data.encode_prompt(q)
        assert prompt[0] == model.vocab.bos_id and prompt[-1] == model.vocab.special("<bov>")
        assert data.decode(prompt[1:-1]) == q.answer
    assert data.video_frames == 5


def test_the_verifier_reads_motion_from_the_frames_a_clip_decodes_to():
    moving = ShapeObject("red", "circle", "large", 1, 1, "moving right")
    scene = Scene(objects=(moving,), index=0, split="val")
    said = caption(scene, include_motion=True)
    query = Query("text_to_video/val/0", "", said, said, "caption_to_video", 1)
    clip = to_tensor(render_video(scene, 5, 32)).numpy()  # float [3, T, H, W] in [-1, 1]: what decode gives
    assert clip.shape == (3, 5, 32, 32)
    assert verifier_for("caption_to_video") is verify_shapes_video
    assert verify_shapes_video(query, clip) == 1.0
    still = np.repeat(clip[:, :1], 5, axis=1)  # the first frame held: everything right but the motion
    assert 0.0 < verify_shapes_video(query, still) < 1.0


# --- the engine and the trainer ----------------------------------------------------------------------


def test_videos_drawn_by_the_engine_are_generate_visuals_with_the_trainers_logprobs_per_code(model, data):
    queries = data.next_queries(3)
    prompts = [data.encode_prompt(q) for q in queries]
    engine = InferenceEngine(model, max_new_tokens=4, temperature=0.0, video_frames=5)
    greedy = engine.generate(prompts, queries)
    reference = flatten_scales(generate_visual(model, prompts, frames=3, temperature=0.0))
    assert [r.response_ids for r in greedy] == (reference + model.vocab.visual_offset).tolist()
    # Sampled, in one batch with an image and a caption prompt: each kind as it would be alone.
    engine = InferenceEngine(model, max_new_tokens=4, seed=1, video_frames=5)
    image = [model.vocab.bos_id, 20, model.vocab.special("<boi>")]
    text = [model.vocab.bos_id, 20, 21]
    mixed = engine.generate([*prompts, image, text], [*queries, queries[0], queries[0]])
    videos = mixed[:3]
    assert len(mixed[3].response_ids) == 21 and len(mixed[4].response_ids) <= 4
    for r in videos:
        assert r.finished and not r.truncated and len(r.response_ids) == CODES == len(r.inf_logprobs)
        assert all(t in model.vocab.visual_range() for t in r.response_ids)
        for chosen in r.routing.values():
            assert chosen.shape == (len(r.prompt_ids) + CODES, 2)  # every code fed, its routing recorded
    assert engine.stats.tokens >= 3 * CODES
    with torch.no_grad():
        logprobs, entropy = sequence_logprobs(model, mixed, replay=True, with_entropy=True)
        plain = sequence_logprobs(model, mixed, replay=False)
    inf = [r.inf_logprobs for r in mixed]
    assert max_gap(logprobs, inf) < 1e-4 and max_gap(plain, inf) < 1e-4
    assert entropy[0].shape == (CODES,) and float(entropy[0].min()) > 0
    assert routing_agreement(model, mixed) == 1.0


def test_the_trainer_lays_a_video_response_out_as_pretraining_lays_a_clip_but_its_closing_token(model, data):
    query = data.next_queries(1)[0]
    prompt = data.encode_prompt(query)
    rollout = InferenceEngine(model, seed=2, video_frames=5).generate([prompt], [query])[0]
    batch = rollout_batch(PromptLayout(model), [(None, rollout.prompt_ids, rollout.response_ids)], left=False)
    codes = model.vocab.visual_codes(rollout.response_ids)
    document = [TextSegment(prompt[:-1], predict=False), VisualSegment(codes=codes, video=True)]
    pretraining = SequenceBuilder(model.vocab, 128, layout=MediaLayout.of(model)).layout_rows(
        [[document]], batch.input_ids.shape[1]
    )
    end = len(prompt) + CODES  # the <eov> the layout writes after the clip
    for name in ("input_ids", "group_id", "modality"):
        assert torch.equal(getattr(batch, name)[:, :end], getattr(pretraining, name)[:, :end]), name
    assert torch.equal(batch.positions[..., :end], pretraining.positions[..., :end])
    assert int(batch.doc_id[0, end]) != int(pretraining.doc_id[0, end])  # masked: no decision of the policy
    frames_t = batch.positions[0, 0, len(prompt) : end].view(3, 21)  # t: one step a latent frame
    assert torch.equal(frames_t - frames_t[0, 0], torch.arange(3)[:, None].expand(3, 21))


def test_verifier_input_and_validation_are_the_decoded_clips_of_the_drawn_codes(model, data):
    queries = data.next_queries(2)
    prompts = [data.encode_prompt(q) for q in queries]
    rollouts = InferenceEngine(model, temperature=0.0, video_frames=5).generate(prompts, queries)
    video = VideoResponse()
    for r in rollouts:
        frames = video.verifier_input(model, r, data)
        assert frames.shape == (3, 5, 32, 32) and frames.dtype == np.float32
        decoded = model.nfsp.decode(video.codes(model, r.response_ids))[0].numpy()
        assert np.array_equal(frames, decoded)
        assert 0.0 <= verify_shapes_video(r.query, frames) <= 1.0
    answered = respond(model, prompts, data.decode, 4, temperature=0.0, video_frames=5)
    for r, frames in zip(rollouts, answered, strict=True):
        # Greedy: the engine's clips (decoded in one batch here, one by one there).
        np.testing.assert_allclose(frames, video.verifier_input(model, r, data), rtol=0, atol=1e-5)
    empty = Rollout(queries[0], prompts[0], [], torch.zeros(0), None, [], False, True)
    assert video.verifier_input(model, empty, data).shape == (3, 1, 32, 32)  # no room: a blank frame


def test_the_scorer_rewards_a_video_rollout_with_verify_shapes_video_of_its_decoded_clip(model, data):
    queries = data.next_queries(4)
    engine = InferenceEngine(model, seed=4, video_frames=5)
    rollouts = engine.generate([data.encode_prompt(q) for q in queries], queries)
    scorer = Scorer(model, ScoringConfig(verifier_workers=0))
    try:
        rewards = scorer.rewards(rollouts, lambda r: scorer.submit(r, data))
    finally:
        scorer.close()
    video = VideoResponse()
    expected = [verify_shapes_video(r.query, video.verifier_input(model, r, data)) for r in rollouts]
    assert rewards == expected == [r.reward for r in rollouts] and scorer.errors == 0


def test_a_videos_codes_are_video_decisions_for_the_per_modality_icepop_bounds(model, data):
    queries = data.next_queries(1)
    image_prompt = [model.vocab.bos_id, 20, model.vocab.special("<boi>")]
    engine = InferenceEngine(model, seed=5, video_frames=5)
    video, image = engine.generate([data.encode_prompt(queries[0]), image_prompt], queries * 2)
    update = PolicyUpdate(model, PolicyLossConfig(), UpdateConfig(), temperature=1.0)
    modality = update.modalities(video, data.token_modality)
    assert modality == [int(Modality.VIDEO)] * CODES
    assert update.modalities(image, data.token_modality) == [int(Modality.IMAGE)] * 21
    alpha, beta = MismatchBounds(video=(0.25, 2.0)).tensors(torch.tensor(modality))  # the video bounds apply
    assert alpha.unique().tolist() == [0.25] and beta.unique().tolist() == [2.0]


# --- RLTask ------------------------------------------------------------------------------------------


def test_an_rl_step_on_text_to_video_trains_on_rewards_read_back_from_the_drawn_clips(tmp_path: Path):
    model = make_model().train()
    data = make_data(model, tasks=("text_to_video", "video_to_text"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    task = RLTask(
        model, rollout=RolloutConfig(max_new_tokens=8),
        update=UpdateConfig(batch_size=4, group_size=4), optim=OptimConfig(lr=1e-3),
        scoring=ScoringConfig(val_max_new_tokens=8),
    )  # fmt: skip
    trainer, logged = fit_logging_metrics(task, data, tmp_path)
    assert task.engine.lengths.video_frames == 5  # the datamodule's clips (rollout.video_frames left out)
    assert sum(step["train/trained_samples"] for step in logged) > 0, "no group's rewards differed"
    assert 0.0 < max(step["train/reward"] for step in logged) <= 1.0
    moved = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert any(k.startswith("backbone.") for k in moved)
    assert not any(k.startswith("nfsp.tokenizer.") for k in moved)  # the frozen tokenizer
    validated = ("caption_to_video/reward", "caption_to_video/reward_sampled", "video_caption/reward")
    for name in (f"val/{n}" for n in validated):
        assert 0.0 <= float(trainer.callback_metrics[name]) <= 1.0


def test_a_rollout_video_length_other_than_the_datas_clips_is_refused(tmp_path: Path):
    model = make_model()
    data = make_data(model)
    update = UpdateConfig(batch_size=2, group_size=2)
    task = RLTask(model, rollout=RolloutConfig(video_frames=3), update=update)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=1, default_root_dir=tmp_path, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"rollout.video_frames=3 but the datamodule's clips have .*=5"):
        trainer.fit(task, datamodule=data)


# --- the config --------------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parent.parent
VIDEO_RL = REPO / "configs" / "rl" / "grpo_video.yaml"
VIDEO_DEMO = REPO / "configs" / "demo" / "video.yaml"


def model_section(path: Path) -> dict:
    """The unified model a config builds, without the file its tokenizer's weights come from (init_from
    brings them to RL)."""
    model = yaml.safe_load(path.read_text())["model"]["init_args"]["model"]
    for component in ("visual_tokenizer", "vision_encoder"):
        model["init_args"][component]["init_args"].pop("weights", None)
    return model


def test_the_video_rl_config_starts_from_the_video_demos_checkpoint_and_architecture():
    config = yaml.safe_load(VIDEO_RL.read_text())
    init_args = config["model"]["init_args"]
    assert init_args["init_from"] == "runs/demo/video/latest/checkpoints/last.ckpt"
    assert config["data"]["init_args"]["tasks"] == ["text_to_video", "video_to_text"]
    assert init_args["rollout"]["video_frames"] is None  # the datamodule's clips
    if not VIDEO_DEMO.is_file():
        pytest.skip("configs/demo/video.yaml (the video demo) is not in this checkout")
    demo = yaml.safe_load(VIDEO_DEMO.read_text())
    assert demo["trainer"]["default_root_dir"] == "runs/demo/video"
    assert model_section(VIDEO_RL) == model_section(VIDEO_DEMO), "init_from would refuse the demo's weights"
    for read_as in ("video_frames", "video_context"):
        assert config["data"]["init_args"][read_as] == demo["data"]["init_args"][read_as]


@pytest.mark.slow
def test_the_video_rl_config_runs_two_grpo_steps_through_zoo_fit(tmp_path: Path, monkeypatch):
    """The config as `zoo fit` runs it (fresh weights in place of the demo's, tiny batches): about 30 s."""
    from zoo.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["zoo"])
    short = {
        "trainer": {
            "max_steps": 2, "val_check_interval": 2, "limit_val_batches": 1, "enable_progress_bar": False,
            "callbacks": [{"class_path": "zoo.tasks.checkpointing.ZooCheckpoint",
                           "init_args": {"save_last": True, "every_n_train_steps": 2}}],
        },
        "model": {"init_args": {
            "init_from": None, "update": {"batch_size": 2, "group_size": 2, "micro_batch_size": 4},
            "rollout": {"max_new_tokens": 8}, "scoring": {"val_max_new_tokens": 8},
        }},
        "data": {"init_args": {"train_size": 8, "heldout_size": 2, "val_batch_size": 2}},
    }  # fmt: skip
    (tmp_path / "short.yaml").write_text(yaml.safe_dump(short))
    main(["fit", "--config", str(VIDEO_RL), "--config", str(tmp_path / "short.yaml")])
    last = tmp_path / "runs/rl_grpo_video/latest/checkpoints/last.ckpt"
    state = torch.load(last, map_location="cpu", weights_only=True)
    assert state["global_step"] == 2 and state["rl_state"]["version"] == 2
