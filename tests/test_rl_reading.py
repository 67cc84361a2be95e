"""RL rewarded by the model's own reading (`zoo.rl.reading_reward`, `ScoringConfig.reward = "reading"`).

A drawn image or utterance is rewarded with the per-token probability a frozen copy of the starting policy
gives its caption when it reads the medium back; no verifier takes part in training. Checked: the reward is
that probability, the one the understanding loss would give the same document; nothing drawn reads as 0;
`RLTask` trains on it with the reader frozen while the policy moves, and still validates with the verifiers;
text tasks and chat models are refused with the reason; the option parses from YAML.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from rl_fit_helpers import fit_logging_metrics
from test_rl_multimodal import make_model, warm, warm_data, warm_model  # noqa: F401 (warm: the fixture)

from zoo.cli import ZooCLI
from zoo.datamodules.sequence import AudioSegment, ContextSegment, TextSegment, VisualSegment
from zoo.rl.reading_reward import ReadingReward
from zoo.rl.records import Rollout
from zoo.rl.responses import ImageResponse, SpeechResponse
from zoo.rl.rollout import InferenceEngine
from zoo.rl.scoring import Scorer, ScoringConfig
from zoo.rl.task import RLTask, RolloutConfig
from zoo.rl.update import OptimConfig, UpdateConfig

MEDIA_TASKS = ("text_to_image", "text_to_audio")


def _understanding_loss(model, builder, caption: list[int], medium) -> float:  # noqa: ANN001
    """The text loss pretraining's understanding document `<bos> medium caption <eos>` gets (mean over the
    caption and `<eos>`), computed by the model's own forward."""
    vocab = model.vocab
    document = [TextSegment([vocab.bos_id], predict=False), medium, TextSegment([*caption, vocab.eos_id])]
    with torch.no_grad():
        return float(model(builder.collate_prompts([document])).heads["text"].loss)


def test_a_reading_reward_is_the_per_token_probability_of_the_caption_read_back(warm):  # noqa: F811
    model = warm_model(warm)
    data = warm_data(model, warm, tasks=MEDIA_TASKS)
    queries = data.next_queries(4)  # two images, two utterances
    rollouts = InferenceEngine(model, seed=3, max_audio_frames=12).generate(
        [data.encode_prompt(q) for q in queries], queries
    )
    scorer = Scorer(model, ScoringConfig(reward="reading", truncated="keep"), reader=model)  # speech is cut
    try:
        rewards = scorer.rewards(rollouts, lambda r: scorer.submit(r, data))
    finally:
        scorer.close()
    builder = scorer._builder
    for query, rollout, reward in zip(queries, rollouts, rewards, strict=True):
        caption = data.encode_text(query.answer)
        assert caption == rollout.prompt_ids[1:-1]  # the caption the prompt asked to render
        if query.task == "caption_to_image":
            pixels = model.nfsp.decode(ImageResponse().codes(model, rollout.response_ids))[0]
            medium = VisualSegment(pixels, predict=False, predict_opener=False)  # this data reads codes
        else:
            codes = SpeechResponse().frames(model, rollout.response_ids)
            medium = AudioSegment(codes=codes, predict=False, predict_opener=False)
        expected = math.exp(-_understanding_loss(model, builder, caption, medium))
        assert 0.0 < reward <= 1.0 and reward == pytest.approx(expected, rel=1e-4)
        assert rollout.reward == reward
    assert scorer.reading.counts == {"read": 4, "unreadable": 0}


def test_speech_that_ends_at_once_reads_as_nothing_and_a_cut_response_scores_zero(warm):  # noqa: F811
    model = warm_model(warm)
    data = warm_data(model, warm, tasks=("text_to_audio",))
    query = data.next_queries(1)[0]
    prompt = data.encode_prompt(query)
    eoa = model.vocab.special("<eoa>")
    frames = torch.zeros(3, model.vocab.audio_levels, dtype=torch.long)
    said = model.vocab.audio_ids(frames).flatten().tolist()
    # (query, prompt, response, l_inf, routing, versions, finished, truncated)
    silent = Rollout(query, prompt, [eoa], torch.zeros(1), None, [], True, False)
    cut = Rollout(query, prompt, said, torch.zeros(len(said)), None, [], False, True)
    spoken = Rollout(query, prompt, [*said, eoa], torch.zeros(len(said) + 1), None, [], True, False)
    scorer = Scorer(model, ScoringConfig(reward="reading", truncated="zero_reward"), reader=model)
    rewards = scorer.rewards([silent, cut, spoken], lambda r: scorer.submit(r, data))
    assert rewards[0] == 0.0 and rewards[1] == 0.0 and 0.0 < rewards[2] <= 1.0
    assert scorer.reading.counts == {"read": 2, "unreadable": 1}


def test_images_read_through_the_vision_encoder_where_the_data_reads_images_so(warm):  # noqa: F811
    model = warm_model(warm)
    data = warm_data(model, warm, tasks=("text_to_image",), image_context=True)
    pixels = torch.zeros(3, 32, 32)
    assert isinstance(data.read(pixels), ContextSegment)
    assert isinstance(warm_data(model, warm, tasks=("text_to_image",)).read(pixels), VisualSegment)


def test_rl_on_reading_rewards_train_the_policy_not_the_reader_and_validate_with_verifiers(warm, tmp_path):  # noqa: F811
    model = warm_model(warm).train()
    data = warm_data(model, warm, tasks=MEDIA_TASKS)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    task = RLTask(
        model, rollout=RolloutConfig(max_new_tokens=24, max_audio_frames=12),
        update=UpdateConfig(batch_size=4, group_size=4), optim=OptimConfig(lr=1e-3),
        scoring=ScoringConfig(reward="reading", val_max_new_tokens=24),
    )  # fmt: skip
    trainer, logged = fit_logging_metrics(task, data, tmp_path)
    assert sum(step["train/trained_samples"] for step in logged) > 0
    assert all(0.0 < step["train/reward"] < 1.0 for step in logged)  # probabilities, never a verifier's 1.0
    moved = [k for k, v in model.state_dict().items() if not torch.equal(v, start[k])]
    assert any(k.startswith("backbone.") for k in moved)
    reader = task.reader.state_dict()
    assert all(torch.equal(reader[k], v) for k, v in start.items())  # the reader stays the starting policy
    metrics = trainer.callback_metrics
    for name in ("val/caption_to_image/reward", "val/caption_to_speech/reward_sampled"):
        assert 0.0 <= float(metrics[name]) <= 1.0  # the verifiers' graded rewards


def test_reading_rewards_refuse_text_tasks_unknown_rewards_and_a_missing_reader(warm, tmp_path: Path):  # noqa: F811
    model = warm_model(warm)
    with pytest.raises(ValueError, match="reward must be 'verifier' or 'reading'"):
        ScoringConfig(reward="oracle")
    with pytest.raises(ValueError, match="needs a reader"):
        Scorer(model, ScoringConfig(reward="reading"))
    with pytest.raises(ValueError, match="takes no reader"):
        Scorer(model, ScoringConfig(), reader=model)
    data = warm_data(model, warm, tasks=("image_to_text", "text_to_image"))
    update, scoring = UpdateConfig(batch_size=2, group_size=2), ScoringConfig(reward="reading")
    task = RLTask(model, update=update, scoring=scoring)
    with pytest.raises(ValueError, match="only a verifier can reward"):
        fit_logging_metrics(task, data, tmp_path)
    reading = ReadingReward(model, Scorer(model, ScoringConfig())._builder)
    assert reading.collect([reading.submit([5], None)])[0].reward == 0.0  # nothing drawn
    with pytest.raises(KeyError):
        reading.collect([0])  # collected once: the ticket is gone


def test_the_reading_reward_is_chosen_in_yaml(tmp_path: Path):
    config = Path(__file__).resolve().parents[1] / "configs"
    cli = ZooCLI(
        args=["--config", str(config / "rl" / "grpo_shapes.yaml"), "--config",
              str(config / "experiments" / "rl_reading.yaml"), "--trainer.logger", "false",
              f"--trainer.default_root_dir={tmp_path}"],
        run=False,
    )  # fmt: skip
    assert cli.model.scoring_config.reward == "reading"
    assert cli.model.reader is not None and not any(p.requires_grad for p in cli.model.reader.parameters())
    assert cli.datamodule.task_names == MEDIA_TASKS
