"""The unified token space: one id range per modality plus the special tokens that switch between them.

Layout (ERNIE 5.0 shares one output space across modalities; we keep the ranges explicit so that
each head predicts only its own slice and an id can always be traced back to its modality):

    [ specials | text | visual codes | audio codes (level 1 .. Q, one block per level) ]

The text tokenizer produces local ids `0 .. text_size-1`; `text_offset` maps them into the unified
space. The text head predicts over `specials + text` so that it can open another modality (BOI, BOA).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

SPECIAL_TOKENS: tuple[str, ...] = (
    "<pad>",
    "<bos>",
    "<eos>",
    "<boi>",  # begin / end of image
    "<eoi>",
    "<bov>",  # begin / end of video
    "<eov>",
    "<boa>",  # begin / end of audio
    "<eoa>",
    "<sep>",
)
# The roles of a conversation (`zoo.datamodules.chat`), present when `UnifiedVocab.chat` is set: after the
# other specials, so a vocabulary without them keeps every id it had.
CHAT_TOKENS: tuple[str, ...] = ("<|system|>", "<|user|>", "<|assistant|>")


@dataclass(frozen=True)
class UnifiedVocab:
    """Id ranges of the unified vocabulary.

    Args:
        text_size: number of text-tokenizer ids.
        visual_size: visual codebook size (shared across scales).
        audio_size: codebook size of each audio RVQ level.
        audio_levels: number of RVQ levels; each level gets its own block of `audio_size` ids.
        chat: add the role tokens of conversations (`CHAT_TOKENS`) to the specials. It moves every text,
            visual and audio id up by their number: a model is trained with them or without them.
    """

    text_size: int = 512
    visual_size: int = 1024
    audio_size: int = 1024
    audio_levels: int = 4
    chat: bool = False

    def __post_init__(self) -> None:
        for name in ("text_size", "visual_size", "audio_size", "audio_levels"):
            if getattr(self, name) < 1:
                raise ValueError(f"UnifiedVocab.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def specials(self) -> tuple[str, ...]:
        return SPECIAL_TOKENS + CHAT_TOKENS if self.chat else SPECIAL_TOKENS

    @property
    def num_special(self) -> int:
        return len(self.specials)

    @property
    def text_offset(self) -> int:
        return self.num_special

    @property
    def visual_offset(self) -> int:
        return self.text_offset + self.text_size

    @property
    def audio_offset(self) -> int:
        return self.visual_offset + self.visual_size

    @property
    def size(self) -> int:
        return self.audio_offset + self.audio_size * self.audio_levels

    @property
    def text_head_size(self) -> int:
        """Outputs of the text head: the special tokens and the text ids."""
        return self.visual_offset

    def special(self, name: str) -> int:
        """Id of a special token by name, e.g. `vocab.special("<eos>")`."""
        try:
            return self.specials.index(name)
        except ValueError:
            if name in CHAT_TOKENS:
                raise KeyError(
                    f"{name} is a role token: this vocabulary has none (UnifiedVocab.chat is false; a model "
                    "trained with chat: true has them)"
                ) from None
            raise KeyError(f"unknown special token {name!r}; known: {', '.join(self.specials)}") from None

    @property
    def pad_id(self) -> int:
        return self.special("<pad>")

    @property
    def bos_id(self) -> int:
        return self.special("<bos>")

    @property
    def eos_id(self) -> int:
        return self.special("<eos>")

    def text_range(self) -> range:
        return range(self.text_offset, self.visual_offset)

    def visual_range(self) -> range:
        return range(self.visual_offset, self.audio_offset)

    def audio_range(self, level: int | None = None) -> range:
        """All audio ids, or those of one level (0-based)."""
        if level is None:
            return range(self.audio_offset, self.size)
        if not 0 <= level < self.audio_levels:
            raise ValueError(f"audio level {level} out of range 0..{self.audio_levels - 1}")
        start = self.audio_offset + level * self.audio_size
        return range(start, start + self.audio_size)

    def text_to_unified(self, ids: Tensor | list[int]) -> Tensor:
        ids = torch.as_tensor(ids, dtype=torch.long)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.text_size):
            raise ValueError(
                f"text ids must lie in 0..{self.text_size - 1}, got {int(ids.min())}..{int(ids.max())}"
            )
        return ids + self.text_offset

    def unified_to_text(self, ids: Tensor | list[int]) -> Tensor:
        ids = torch.as_tensor(ids, dtype=torch.long)
        r = self.text_range()
        if ids.numel() and (int(ids.min()) < r.start or int(ids.max()) >= r.stop):
            raise ValueError(f"ids must lie in the text range {r.start}..{r.stop - 1}")
        return ids - self.text_offset

    # -- media codes as unified ids (a media response, codes fed back as ids) ---------------------------
    def visual_ids(self, codes: Tensor) -> Tensor:
        """Visual codebook codes (any shape) -> unified visual ids."""
        return codes + self.visual_offset

    def visual_codes(self, ids: Tensor | list[int]) -> Tensor:
        """Unified visual ids -> codebook codes; refuses ids outside the visual range."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        self.check_ids(ids, self.visual_range())
        return ids - self.visual_offset

    def audio_ids(self, codes: Tensor) -> Tensor:
        """RVQ codes `[..., Q]` (level q in column q) -> unified audio ids, level q in its own block."""
        levels = torch.arange(codes.shape[-1], device=codes.device) * self.audio_size
        return codes + levels + self.audio_offset

    def audio_codes(self, ids: Tensor | list[int]) -> Tensor:
        """Unified audio ids, frame after frame (Q a frame, level 1 first) -> RVQ codes `[F, Q]`; refuses
        an id outside its level's block and a count that is not whole frames."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        if ids.numel() % self.audio_levels:
            raise ValueError(f"{ids.numel()} audio ids are not whole frames of {self.audio_levels} levels")
        frames = ids.view(-1, self.audio_levels)
        codes = frames - self.audio_offset - torch.arange(self.audio_levels) * self.audio_size
        bad = ((codes < 0) | (codes >= self.audio_size)).nonzero()
        if len(bad):
            f, q = bad[0].tolist()
            block = self.audio_range(q)
            raise ValueError(
                f"audio id {int(frames[f, q])} (frame {f}, level {q + 1}) lies outside that level's ids "
                f"{block.start}..{block.stop - 1}"
            )
        return codes

    def check_ids(self, ids: Tensor, allowed: range | None = None) -> None:
        """Refuse out-of-range ids with a message naming the offending id and the allowed range."""
        allowed = allowed or range(0, self.size)
        if ids.numel() == 0:
            return
        bad = (ids < allowed.start) | (ids >= allowed.stop)
        if bool(bad.any()):
            first = int(ids[bad].flatten()[0])
            raise ValueError(
                f"token id {first} is outside the allowed range {allowed.start}..{allowed.stop - 1}"
            )

    def modality_of(self, token_id: int) -> str:
        if 0 <= token_id < self.num_special:
            return "special"
        if token_id in self.text_range():
            return "text"
        if token_id in self.visual_range():
            return "visual"
        if token_id in self.audio_range():
            return "audio"
        raise ValueError(f"token id {token_id} outside the unified vocabulary 0..{self.size - 1}")
