"""Response kinds as a specification (zoo/rl/responses.py): which kind a prompt asks for, what each kind
may generate and which positions it takes, and the code-id arithmetic of media responses (UnifiedVocab)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "golden"))
from make_generations import media_model, text_model  # noqa: E402

from zoo.datamodules.sequence import TextSegment  # noqa: E402
from zoo.rl.responses import (  # noqa: E402
    ImageResponse,
    MediaLengths,
    SpeechResponse,
    TextResponse,
    response_kind,
)
from zoo.tokenizers.vocab import UnifiedVocab  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return media_model()


def test_the_last_prompt_id_asks_for_an_image_or_speech_when_the_model_can_make_them(model):
    vocab = model.vocab
    boi, boa = vocab.special("<boi>"), vocab.special("<boa>")
    assert isinstance(response_kind(model, [vocab.bos_id, 20, boi]), ImageResponse)
    assert isinstance(response_kind(model, [vocab.bos_id, 20, boa]), SpeechResponse)
    assert isinstance(response_kind(model, [vocab.bos_id, 20]), TextResponse)
    captioned = [TextSegment([vocab.bos_id, boi])]  # a prompt with media is captioned
    assert isinstance(response_kind(model, captioned), TextResponse)
    text_only = text_model()
    assert isinstance(response_kind(text_only, [text_only.vocab.bos_id, boi]), TextResponse)


def test_an_image_is_whole_or_nothing_and_speech_takes_one_position_a_frame(model):
    image, speech, text = ImageResponse(), SpeechResponse(), TextResponse()
    codes, nine = model.nfsp.tokens_per_frame, MediaLengths(audio_frames=9)
    assert image.budget(model, tokens=4, lengths=nine, room=codes) == codes
    assert image.budget(model, tokens=4, lengths=nine, room=codes - 1) == 0
    assert speech.budget(model, tokens=4, lengths=nine, room=5) == 5 and text.budget(model, 4, nine, 5) == 4
    frames = torch.tensor([[3, 0, 7, 255], [1, 2, 3, 4]])
    said = model.vocab.audio_ids(frames).flatten().tolist()
    ended = said + [model.vocab.special("<eoa>")]  # END is a decision, not a position
    assert speech.positions(model, said) == 2 == speech.positions(model, ended)
    assert torch.equal(speech.frames(model, ended), frames)
    assert text.positions(model, [5, 6, 7]) == 3 == image.positions(model, [5, 6, 7])


def test_media_codes_become_unified_ids_and_back_and_foreign_ids_are_refused():
    vocab = UnifiedVocab(text_size=64, visual_size=128, audio_size=16, audio_levels=2)
    codes = torch.tensor([0, 5, 127])
    assert vocab.visual_ids(codes).tolist() == [vocab.visual_offset + c for c in (0, 5, 127)]
    assert torch.equal(vocab.visual_codes(vocab.visual_ids(codes)), codes)
    frames = torch.tensor([[0, 15], [3, 4]])
    ids = vocab.audio_ids(frames)
    start = vocab.audio_offset  # level 1's block, then level 2's (16 ids each)
    assert ids.tolist() == [[start, start + 16 + 15], [start + 3, start + 16 + 4]]
    assert torch.equal(vocab.audio_codes(ids.flatten()), frames)
    with pytest.raises(ValueError, match="outside the allowed range"):
        vocab.visual_codes([vocab.text_offset])
    with pytest.raises(ValueError, match="not whole frames of 2 levels"):
        vocab.audio_codes(ids.flatten()[:3])
    with pytest.raises(ValueError, match=r"frame 0, level 2\) lies outside that level's ids"):
        vocab.audio_codes([vocab.audio_offset, vocab.audio_offset + 1])  # two level-1 ids in one frame
