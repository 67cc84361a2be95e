"""Images and speech tokenized in the dataloader workers: documents reach the training step as codes.

The unified model tokenizes a batch's pixels and waveforms itself, every step, with its frozen visual
tokenizer and audio codec (`NFSP.encode`, `NCP.encode`). On a GPU that costs little. On a CPU it is about a
sixth of the step, spent on the training process: measured on `make demo`'s unified stage at one thread,
rendering took 0.11 of a step, the codec's encoder 0.13 and the visual tokenizer's 0.03. What it buys is in
docs/benchmarks.md (`benchmarks/loader_tokenizing.py`): 1.46x a one-thread training process, and about what
a second torch thread buys (1.04x) on two cores.

With `tokenize_in_loader` a datamodule hands its workers copies of the model's frozen tokenizers, and each
document's media become `VisualSegment(codes=...)` / `AudioSegment(codes=...)`, the path code shards already
take (`zoo.datamodules.code_shards`). The codes are the ones the model would have made: the same frozen
modules, and `FrozenTokenizers` encodes exactly as `NFSP.encode` and `NCP.encode` do
(`tests/test_loader_tokenizing.py` compares the losses).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from zoo.datamodules.sequence import AudioSegment, Document, VisualSegment

if TYPE_CHECKING:
    from zoo.datamodules.frozen_tokenizers import FrozenTokenizers


def frozen_copies(visual: nn.Module | None, audio: nn.Module | None) -> FrozenTokenizers:
    """CPU copies of a model's frozen visual tokenizer and audio codec, for the loader's workers: the
    model's own modules stay where the strategy puts them, and nothing the workers do can touch them."""
    from zoo.datamodules.frozen_tokenizers import FrozenTokenizers

    def cpu_copy(module: nn.Module | None) -> nn.Module | None:
        if module is None:
            return None
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if type(tensor) not in (torch.Tensor, nn.Parameter) or tensor.is_meta:
                raise ValueError(
                    f"tokenize_in_loader needs the model's tokenizers built and unsharded when the data is "
                    f"set up, but {type(module).__name__}.{name} is a {type(tensor).__name__}"
                    f"{' on the meta device' if tensor.is_meta else ''}: turn tokenize_in_loader off"
                )
        return copy.deepcopy(module).cpu()

    return FrozenTokenizers(cpu_copy(visual), cpu_copy(audio))


def tokenize_document(document: Document, tokenizers: FrozenTokenizers) -> Document:
    """`document` with every image, clip and waveform as its codes (segments already holding codes, and
    media a tokenizer is missing for, are left as they are; the model then reports what it lacks)."""
    visual, audio = tokenizers.visual is not None, tokenizers.audio is not None
    out = []
    for segment in document:
        if isinstance(segment, VisualSegment) and segment.pixels is not None and visual:
            video = segment.pixels.dim() == 4
            ((flat, _),) = tokenizers.encode_visual([segment.pixels], video)
            codes = torch.from_numpy(flat.astype("int64"))
            segment = dataclasses.replace(segment, pixels=None, codes=codes, video=video)
        elif isinstance(segment, AudioSegment) and segment.wave is not None and audio:
            (codes,) = tokenizers.encode_audio([segment.wave])
            segment = dataclasses.replace(segment, wave=None, codes=torch.from_numpy(codes.astype("int64")))
        out.append(segment)
    return out


class TokenizedDocuments:
    """A document maker with its documents' media tokenized (`tokenize_document`): a map-style dataset's
    `make(index, epoch)` or a stream's `map(sample)`. Picklable, so spawned workers receive it as forked
    ones do."""

    def __init__(self, make: Callable[..., Document], tokenizers: FrozenTokenizers) -> None:
        self.make, self.tokenizers = make, tokenizers

    def __call__(self, *key: object) -> Document:
        return tokenize_document(self.make(*key), self.tokenizers)
