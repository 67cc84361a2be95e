"""The chat format (`zoo.datamodules.chat`, issue 16 item 2): role tokens in the unified vocabulary, a
conversation laid out as one document, the loss on the assistant's answers only, and the pipeline answering
a conversation in that format; a model without role tokens keeps its ids and the plain layout.
"""

from __future__ import annotations

import pytest
import torch
from code_shard_helpers import VOCAB, write_text_tokenizer, write_tokenizers
from PIL import Image

from zoo.batch import IGNORE_INDEX
from zoo.datamodules.chat import ChatError, EnvironmentText, Turn, chat_document, plain_layout
from zoo.datamodules.documents import decode_text
from zoo.datamodules.paired_documents import DocumentMaker
from zoo.datamodules.sequence import MediaLayout, SequenceBuilder, TextSegment, VisualSegment
from zoo.inference import Pipeline
from zoo.models.backbone import UnifiedTransformer
from zoo.models.generation import generate_text
from zoo.models.unified import UnifiedModel
from zoo.rl.envs.tools import ToolEnvironment, call_of, result_text
from zoo.rl.instructions import ToolInstructions
from zoo.tokenizers.text import TextTokenizer
from zoo.tokenizers.vocab import CHAT_TOKENS, SPECIAL_TOKENS, UnifiedVocab

CHAT = UnifiedVocab(text_size=VOCAB.text_size, visual_size=64, audio_size=32, audio_levels=2, chat=True)
TEXTS = ["what is drawn here", "a red square", "and the colour", "red", "be brief"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> TextTokenizer:
    return TextTokenizer.load(write_text_tokenizer(tmp_path_factory.mktemp("chat") / "t.json", TEXTS))


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> UnifiedModel:
    visual, audio = write_tokenizers(tmp_path_factory.mktemp("tokenizers")).load()
    torch.manual_seed(2)
    backbone = UnifiedTransformer(
        dim=32, n_layers=2, n_heads=2, n_kv_heads=1, n_experts=4, expert_hidden=16, top_k=2, max_seq_len=512
    )
    return UnifiedModel(backbone, CHAT, mtp_depth=0, visual_tokenizer=visual, audio_codec=audio).eval()


def maker(vocab: UnifiedVocab, tokenizer: TextTokenizer) -> DocumentMaker:
    return DocumentMaker(vocab, tokenizer, MediaLayout(visual_scales=(1, 2, 4, 8)), 512)


def test_role_tokens_follow_the_other_specials_and_a_vocabulary_without_them_keeps_its_ids():
    plain = UnifiedVocab(text_size=VOCAB.text_size, visual_size=64, audio_size=32, audio_levels=2)
    assert CHAT.specials == SPECIAL_TOKENS + CHAT_TOKENS
    assert CHAT.text_offset == plain.text_offset + len(CHAT_TOKENS) and CHAT.size == plain.size + 3
    assert [CHAT.special(t) for t in CHAT_TOKENS] == list(range(len(SPECIAL_TOKENS), CHAT.text_offset))
    assert CHAT.special("<eos>") == plain.special("<eos>")
    assert plain.text_offset == len(SPECIAL_TOKENS), "a model trained without role tokens keeps every id"
    with pytest.raises(KeyError, match="chat is false"):
        plain.special("<|user|>")


def test_a_conversation_is_one_document_with_its_roles_and_ends_asking_the_assistant(tokenizer):
    make = maker(CHAT, tokenizer)
    image = VisualSegment(torch.zeros(3, 32, 32))
    turns = [
        Turn("system", ("be brief",)),
        Turn("user", ("what is drawn here", image)),
        Turn("assistant", ("a red square",)),
        Turn("user", ("and the colour",)),
    ]
    document = chat_document(make, turns)
    ids = [s.ids if isinstance(s, TextSegment) else type(s).__name__ for s in document]
    role = CHAT.special
    assert ids == [
        [CHAT.bos_id], [role("<|system|>")], make.ids("be brief"),
        [role("<|user|>")], make.ids("what is drawn here"), "VisualSegment",
        [role("<|assistant|>")], make.ids("a red square"), [CHAT.eos_id],
        [role("<|user|>")], make.ids("and the colour"), [role("<|assistant|>")],
    ]  # fmt: skip
    assert not any(s.predict for s in document), "a prompt predicts nothing"
    with pytest.raises(ChatError, match="ends with the assistant's turn"):
        chat_document(make, turns[:3])
    with pytest.raises(ChatError, match="unknown role 'tool'"):
        chat_document(make, [Turn("tool", ("4",))])  # type: ignore[arg-type]
    with pytest.raises(ChatError, match="no role tokens"):
        chat_document(maker(VOCAB, tokenizer), turns)


def test_in_training_only_the_assistants_answers_and_their_eos_are_targets(tokenizer):
    make = maker(CHAT, tokenizer)
    turns = [Turn("user", ("what is drawn here",)), Turn("assistant", ("a red square",)),
             Turn("user", ("and the colour",)), Turn("assistant", ("red",))]  # fmt: skip
    document = chat_document(make, turns, answers_predicted=True)
    batch = SequenceBuilder(CHAT, 64).collate([document])
    targets = batch.targets["text"][0]
    predicted = targets[targets != IGNORE_INDEX].tolist()
    assert predicted == [*make.ids("a red square"), CHAT.eos_id, *make.ids("red"), CHAT.eos_id]


def test_a_tool_result_in_an_answer_is_input_with_the_environments_ids_and_never_a_target(tokenizer):
    """SFT on a tool transcript (`ToolInstructions`) trains the call and the final answer, not the
    calculator's result, and lays the result out with exactly the ids the environment injects into a
    rollout after that call."""
    make = maker(CHAT, tokenizer)
    user, assistant = ToolInstructions(train_size=4, val_size=1).conversation("train", 0, 0, None)  # type: ignore[arg-type]
    call, result, answer = assistant.parts
    assert isinstance(result, EnvironmentText) and not isinstance(call, EnvironmentText)
    assert result == result_text(call_of(call)) and answer.startswith(" Answer: ")

    def laid_out(answer_turn: Turn):
        document = chat_document(make, [user, answer_turn], answers_predicted=True)
        return SequenceBuilder(CHAT, 128).collate([document])

    batch = laid_out(assistant)
    targets = batch.targets["text"][0]
    assert targets[targets != IGNORE_INDEX].tolist() == [*make.ids(call), *make.ids(answer), CHAT.eos_id]
    environment = ToolEnvironment(lambda ids: decode_text(tokenizer, CHAT, ids), make.ids)
    owed = environment.owed(make.ids(call), [False] * len(make.ids(call)))
    assert owed == make.ids(result), "the environment's ids after the call"
    ids = batch.input_ids[0].tolist()
    answer_ids = [*make.ids(call), *owed, *make.ids(answer)]
    assert any(ids[i : i + len(answer_ids)] == answer_ids for i in range(len(ids))), "laid out in place"
    whole = laid_out(Turn("assistant", (call + result + answer,))).targets["text"][0]
    assert (whole != IGNORE_INDEX).sum() > (targets != IGNORE_INDEX).sum(), "the same text as a str: trained"


def test_the_pipeline_answers_a_conversation_in_the_chat_format(chat_model, tokenizer, tmp_path):
    pipe = Pipeline(chat_model, tokenizer)
    turns = [Turn("user", ("what is drawn here",)), Turn("assistant", ("a red square",)),
             Turn("user", ("and the colour",))]  # fmt: skip
    answer = "".join(pipe.chat(turns, max_new_tokens=8, temperature=0))
    ids = [s.ids for s in chat_document(pipe.maker, turns)]
    prompt = [i for segment in ids for i in segment]
    expected = generate_text(chat_model, [prompt], 8, temperature=0)[0]
    expected = expected[: expected.index(CHAT.eos_id)] if CHAT.eos_id in expected else expected
    assert answer == decode_text(tokenizer, CHAT, expected)
    # A model with role tokens reads every medium of a conversation: two images are one document.
    Image.new("RGB", (32, 32), "red").save(tmp_path / "a.png")
    first, second = pipe.read_media("image", tmp_path / "a.png"), pipe.read_media("image", tmp_path / "a.png")
    batch = pipe.conversation_batch([Turn("user", ("what is drawn here", first, second))])
    assert batch.visual is not None and len(batch.visual.items) == 2


def test_a_model_without_role_tokens_gets_the_plain_layout():
    image = VisualSegment(torch.zeros(3, 32, 32))
    text, media = plain_layout([Turn("user", ("what is drawn here", image)), Turn("assistant", ("a red",))])
    assert text == "what is drawn here\na red" and media is image
    with pytest.raises(ChatError, match="at most one image or audio a conversation"):
        plain_layout([Turn("user", (image, image), "messages[0]")])
    with pytest.raises(ChatError, match="empty"):
        plain_layout([])


def test_a_turn_may_hold_a_pil_image_a_path_or_an_audio_array(chat_model, tokenizer, tmp_path):
    import numpy as np

    pipe = Pipeline(chat_model, tokenizer)
    picture = Image.new("RGB", (40, 48), "blue")
    picture.save(tmp_path / "b.png")
    tone = (0.3 * np.sin(np.arange(8000) / 5)).astype(np.float32)
    from_pil = pipe.conversation_batch([Turn("user", ("what is drawn here", picture))])
    from_path = pipe.conversation_batch([Turn("user", ("what is drawn here", tmp_path / "b.png"))])
    assert torch.equal(from_pil.visual.image_pixels, from_path.visual.image_pixels)
    assert pipe.conversation_batch([Turn("user", ((tone, 16000),))]).audio is not None
    with pytest.raises(TypeError, match="a part is a str"):
        pipe.conversation_batch([Turn("user", (3,))])  # type: ignore[arg-type]
