"""SFT (issue 18 item 1): conversations from a jsonl in the messages format and from the built-in instruction
sources, laid out in the chat format with the loss on the assistant's turns only, packed, bad lines named and
counted; the layout training sees is the one `zoo.inference` prompts with; `SupervisedFineTuning` trains.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from code_shard_helpers import audio_bytes, image_bytes, write_text_tokenizer, write_tokenizers

from zoo.batch import IGNORE_INDEX, NO_SLOT
from zoo.datamodules.bad_samples import BadSamplePolicy
from zoo.datamodules.chat import Turn
from zoo.datamodules.conversations import ConversationDataModule, JsonlConversations
from zoo.datamodules.instructions import ShapesInstructions
from zoo.inference import Pipeline
from zoo.models.backbone import UnifiedTransformer
from zoo.models.unified import UnifiedModel
from zoo.rl.envs.data import InstructionRLDataModule, ToolRLDataModule
from zoo.rl.instructions import ArithmeticInstructions, FormatInstructions, ToolInstructions
from zoo.tasks.sft import SupervisedFineTuning
from zoo.tokenizers.text import TextTokenizer
from zoo.tokenizers.vocab import UnifiedVocab

CHAT = UnifiedVocab(text_size=320, visual_size=64, audio_size=32, audio_levels=2, chat=True)
TEXTS = ["be brief", "what is drawn here", "a red square", "what is said", "hello there", "draw a cat"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> TextTokenizer:
    return TextTokenizer.load(write_text_tokenizer(tmp_path_factory.mktemp("sft") / "t.json", TEXTS))


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> UnifiedModel:
    visual, audio = write_tokenizers(tmp_path_factory.mktemp("tokenizers")).load()
    torch.manual_seed(2)
    backbone = UnifiedTransformer(
        dim=32, n_layers=2, n_heads=2, n_kv_heads=1, n_experts=4, expert_hidden=16, top_k=2, max_seq_len=512
    )
    return UnifiedModel(backbone, CHAT, mtp_depth=0, visual_tokenizer=visual, audio_codec=audio).eval()


def write_conversations(folder: Path, extra: list[str] = ()) -> Path:
    """A jsonl of two good conversations (an image and a wav in user turns, a system prompt, a string and a
    list content) and the `extra` lines; the media files it names beside it."""
    (folder / "media").mkdir(parents=True, exist_ok=True)
    (folder / "media" / "a.png").write_bytes(image_bytes(0))
    (folder / "media" / "s.wav").write_bytes(audio_bytes(1, rate=16000, seconds=0.25))
    lines = [
        {"messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "what is drawn here"},
                                         {"type": "image", "path": "media/a.png"}]},
            {"role": "assistant", "content": "a red square"},
        ]},
        {"messages": [
            {"role": "user", "content": [{"type": "audio", "path": "media/s.wav"},
                                         {"type": "text", "text": "what is said"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "hello there"}]},
        ]},
    ]  # fmt: skip
    path = folder / "chat.jsonl"
    path.write_text("\n".join([*(json.dumps(line) for line in lines), *extra]) + "\n")
    return path


def datamodule(sources, model: UnifiedModel, tokenizer: TextTokenizer, **kwargs) -> ConversationDataModule:
    data = ConversationDataModule(sources, vocab=CHAT, seq_len=256, batch_size=2, **kwargs)
    data.resolve_media(model)  # what setup does with the trainer's model
    data.tokenizer = tokenizer
    data.setup("fit")
    return data


def answer_ids(data: ConversationDataModule, *answers: str) -> list[int]:
    maker = data.maker()
    return [i for a in answers for i in [*maker.ids(a), CHAT.eos_id]]


def test_a_jsonl_conversation_with_an_image_and_a_wav_trains_only_the_assistants_answers(
    tmp_path, chat_model, tokenizer
):
    data = datamodule([JsonlConversations(str(write_conversations(tmp_path)))], chat_model, tokenizer)
    first = data.datasets["train"][(0, 0)]
    second = data.datasets["train"][(1, 0)]
    batch = data.builder.collate([first, second])
    assert batch.visual is not None and batch.audio is not None, "the image and the wav are in the batch"
    targets = batch.targets["text"]
    predicted = targets[targets != IGNORE_INDEX].tolist()
    # Every target is an answer token or its <eos>: had a user token (the one before the image's <boi>, or
    # the role token before the audio's <boa>) carried loss, <boi> / <boa> would be among them.
    assert predicted == answer_ids(data, "a red square", "hello there")
    assert (batch.targets["visual"] == NO_SLOT).all(), "a user's image is read, never predicted"
    assert (batch.targets["audio"] == NO_SLOT).all() and not batch.targets["audio_end"].any()


def test_conversations_are_packed_several_a_row_and_kept_apart_by_document_ids(chat_model, tokenizer):
    source = ArithmeticInstructions(tasks=("add",), difficulties=(1,), train_size=8, val_size=4)
    data = datamodule([source], chat_model, tokenizer)
    documents = [data.datasets["train"][(i, 0)] for i in range(8)]
    batch = data.builder.collate(documents)
    assert batch.batch_size == 1, "eight short conversations share one row of 256"
    assert batch.doc_id[0].unique().numel() - 1 == 8, "each conversation its own document (and padding)"


def test_bad_lines_are_named_by_file_and_line_and_counted_as_bad_samples(tmp_path, chat_model, tokenizer):
    bad = [
        "{not json",
        json.dumps({"messages": [{"role": "tool", "content": "4"}, {"role": "assistant", "content": "4"}]}),
        json.dumps({"messages": [{"role": "user", "content": [{"type": "image", "path": "missing.png"}]},
                                 {"role": "assistant", "content": "a red square"}]}),  # fmt: skip
        json.dumps({"messages": [{"role": "user", "content": "what is drawn here"}]}),
    ]
    path = write_conversations(tmp_path, bad)
    policy = BadSamplePolicy(max_bad_fraction=1.0, min_samples=1)
    data = datamodule([JsonlConversations(str(path))], chat_model, tokenizer, bad_samples=policy)
    dataset = data.datasets["train"]
    records = [dataset.deliver((i, 0)).bad for i in range(6)]
    assert [len(r) for r in records] == [0, 0, 1, 1, 1, 1]
    reasons = [r[0].reason for r in records[2:]]
    assert f"{path}:3" in reasons[0] and "not a JSON object" in reasons[0]
    assert f"{path}:4 messages[0]" in reasons[1] and "unknown role 'tool'" in reasons[1]
    assert f"{path}:5 messages[0].content[0]" in reasons[2] and "missing.png" in reasons[2]
    assert f"{path}:6" in reasons[3] and "no assistant answer" in reasons[3]
    loader = data.train_dataloader()
    for _ in loader:
        pass
    assert data.bad_samples == 4, "the loader counts each bad line it replaced"


def test_training_lays_a_conversation_out_as_the_pipeline_prompts_with_it(tmp_path, chat_model, tokenizer):
    data = datamodule([JsonlConversations(str(write_conversations(tmp_path)))], chat_model, tokenizer)
    pipe = Pipeline(chat_model, tokenizer)
    turns = data.turns("train", 0)
    trained = data.builder.collate([data.make_document("train", 0, 0)])
    prompt = pipe.conversation_batch(
        [Turn("system", ("be brief",)), Turn("user", ("what is drawn here", tmp_path / "media" / "a.png"))]
    )
    n = prompt.seq_len
    for field in ("input_ids", "modality", "group_id", "doc_id"):
        assert torch.equal(getattr(trained, field)[:, :n], getattr(prompt, field)), field
    assert torch.equal(trained.positions[:, :, :n], prompt.positions)
    assert torch.equal(trained.visual.image_pixels, prompt.visual.image_pixels), "the same pixels"
    # The first target after the prompt is the answer's first token: training answers where inference asks.
    assert int(trained.targets["text"][0, n - 1]) == data.maker().ids("a red square")[0]
    assert turns[-1].role == "assistant"


def test_shapes_instructions_teach_captioning_images_and_speech_and_drawing_and_speaking(
    chat_model, tokenizer
):
    tasks = {"describe_image": 1.0, "describe_speech": 1.0, "draw": 1.0, "say": 1.0}
    source = ShapesInstructions(**tasks, train_size=32, val_size=8, test_size=8, max_objects=1)
    data = datamodule([source], chat_model, tokenizer)
    seen = {}
    for index in range(32):
        task, _ = source.task_of("train", index, 0)
        seen.setdefault(task, data.builder.collate([data.make_document("train", index, 0)]))
    assert set(seen) == set(tasks)
    boi, boa = CHAT.special("<boi>"), CHAT.special("<boa>")

    def predicted(task: str) -> list[int]:
        targets = seen[task].targets["text"]
        return targets[targets != IGNORE_INDEX].tolist()

    assert (seen["draw"].targets["visual"] != NO_SLOT).sum() == 1 + 4 + 16 + 64, "the drawn image's codes"
    assert predicted("draw") == [boi, CHAT.eos_id], "the assistant opens the image, then ends its turn"
    assert (seen["say"].targets["audio"] != NO_SLOT).any() and seen["say"].targets["audio_end"].any()
    assert predicted("say") == [boa, CHAT.eos_id]
    for task in ("describe_image", "describe_speech"):
        assert boi not in predicted(task) and boa not in predicted(task), "the user's medium is no target"
        for head in ("visual", "audio"):
            assert (seen[task].targets.get(head, torch.tensor(NO_SLOT)) == NO_SLOT).all(), (task, head)
    # Held out: "val" never repeats a training scene, "test" holds compositions training never sees.
    train = {str(source.world.scene(i, "train")) for i in range(32)}
    assert not train & {str(source.world.scene(i, "val")) for i in range(8)}
    held_out = source.world.heldout_pairs
    assert all(any(o.pair in held_out for o in source.world.scene(i, "test").objects) for i in range(8))


def test_arithmetic_instructions_answer_with_the_worked_solution_and_hold_out_rls_prompts():
    source = ArithmeticInstructions(tasks=("arith",), difficulties=(2,), train_size=200, val_size=50)
    user, assistant = source.conversation("train", 0, 0, None)  # type: ignore[arg-type]
    query = source.query("train", 0)
    assert user.parts == (query.prompt,) and assistant.parts == (query.solution,)
    assert query.solution.endswith(f"={query.answer}") and query.solution.count("=") == 2, "step by step"
    train = {source.query("train", i).prompt for i in range(200)}
    assert not train & {source.query("val", i).prompt for i in range(50)}, "no held-out prompt is trained"


@pytest.mark.parametrize(
    "source, rl",
    [
        (FormatInstructions(counts=(1, 2), train_size=64, val_size=16),
         InstructionRLDataModule(counts=(1, 2), train_size=64, heldout_size=16)),
        (ToolInstructions(difficulties=(1, 2), train_size=64, val_size=16),
         ToolRLDataModule(difficulties=(1, 2), train_size=64, heldout_size=16)),
    ],
)  # fmt: skip
def test_environment_instructions_are_rls_queries_answered_with_a_reference_its_verifier_accepts(source, rl):
    """SFT on the instruction and tool environments (so that stages 3 and 4 of the chain have a policy that
    already writes the format): the same prompts as RL's, held out where RL holds out, and every reference
    answer scores 1 with RL's verifier (a wrong final answer does not)."""
    assert [source.query("train", i).prompt for i in range(64)] == [q.prompt for q in rl.train_queries()]
    assert [source.query("val", i).prompt for i in range(16)] == [q.prompt for q in rl.heldout_queries()]
    assert not {q.prompt for q in rl.train_queries()} & {q.prompt for q in rl.heldout_queries()}
    for i in range(16):
        user, assistant = source.conversation("val", i, 0, None)  # type: ignore[arg-type]
        query = source.query("val", i)
        assert user.parts == (query.prompt,) and "".join(assistant.parts) == query.solution
        assert source.verify("val", i, query.solution) == 1.0
    tool = source.query("val", 0)
    if tool.task == "tool_calc":
        assert "<tool>calc:" in tool.solution
        assert source.verify("val", 0, tool.solution.replace(f"Answer: {tool.answer}", "Answer: 1")) == 0.0


def test_sft_refuses_a_vocabulary_without_role_tokens_and_data_that_is_not_conversations(chat_model):
    plain = UnifiedModel(
        UnifiedTransformer(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, n_experts=2, expert_hidden=8),
        UnifiedVocab(text_size=320, visual_size=64, audio_size=32, audio_levels=2),
    )
    with pytest.raises(ValueError, match="vocab.chat: true"):
        SupervisedFineTuning(plain)
    from zoo.datamodules.shapes_data import ShapesDataModule

    task = SupervisedFineTuning(chat_model)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    trainer.strategy.connect(task)
    task.trainer = trainer
    trainer.datamodule = ShapesDataModule(vocab=CHAT)
    with pytest.raises(TypeError, match="ConversationDataModule"):
        task.setup("fit")


class ScriptedArithmetic(ArithmeticInstructions):
    """Arithmetic conversations whose verifier records the answers it is given and scores them 1.0 at even
    indices, 0.25 at odd ones: what validation logs is then known whatever the untrained model says."""

    def __init__(self) -> None:
        super().__init__(tasks=("arith",), difficulties=(1,), train_size=16, val_size=5)
        self.answers: dict[int, str] = {}

    def verify(self, split: str, index: int, answer: str) -> float:
        assert split == "val"
        self.answers[index] = answer
        return 1.0 if index % 2 == 0 else 0.25


def test_arithmetic_instructions_verify_answers_with_rls_verifier():
    source = ArithmeticInstructions(tasks=("arith",), difficulties=(2,), train_size=4, val_size=4)
    query = source.query("val", 1)
    assert source.verifiable and source.verify("val", 1, query.solution) == 1.0
    assert source.verify("val", 1, query.solution + "1") == 0.0


def test_sft_validation_answers_heldout_prompts_greedily_in_the_chat_format_and_logs_the_verifiers_accuracy():
    source = ScriptedArithmetic()
    tokenizer = TextTokenizer.train(list(source.texts()), vocab_size=300, min_frequency=1)
    data = ConversationDataModule([source], vocab=CHAT, seq_len=128, batch_size=4)
    data.tokenizer = tokenizer
    torch.manual_seed(0)
    backbone = UnifiedTransformer(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, n_experts=2, expert_hidden=8)
    model = UnifiedModel(backbone, CHAT, mtp_depth=0)
    task = SupervisedFineTuning(model, greedy_prompts=4, greedy_max_new_tokens=6)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=2, val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(task, datamodule=data)
    assert sorted(source.answers) == [0, 1, 2, 3], "greedy_prompts held-out conversations, not all five"
    assert trainer.callback_metrics["val/accuracy"].item() == pytest.approx(0.5)
    assert trainer.callback_metrics["val/reward"].item() == pytest.approx((1.0 + 0.25 + 1.0 + 0.25) / 4)
    # The answers verified are the model's greedy continuations of `<bos> <|user|> prompt <|assistant|>`.
    model, vocab = task.model.eval(), CHAT
    for index, answer in source.answers.items():
        prompt = source.query("val", index).prompt
        question = vocab.text_to_unified(tokenizer.encode(prompt)).tolist()
        ids = [vocab.bos_id, vocab.special("<|user|>"), *question, vocab.special("<|assistant|>")]
        out = model.generate([ids], 6, temperature=0.0)[0]
        out = out[: out.index(vocab.eos_id)] if vocab.eos_id in out else out
        text = tokenizer.decode([i - vocab.text_offset for i in out if i in vocab.text_range()])
        assert answer == text
