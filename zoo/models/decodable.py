"""What the decoding core needs of a model: the one typed contract between `UnifiedModel` and its loops.

The decode steps and loops (`decode.py`, `generation.py`, `media_generation.py`) sit on the model's pass
(docs/architecture.md, "Decoding"), while `UnifiedModel.generate` offers the text loop as a method. Were the
loops typed with `UnifiedModel` itself, the model and its loops would import each other (a cycle, even if
for type checking only). They are typed with this protocol instead, which `UnifiedModel` satisfies; a field
or method a decode step starts to read is added here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from torch import Tensor, nn

from zoo.batch import GroupBatch
from zoo.models.backbone import BackboneOutput, UnifiedTransformer
from zoo.models.elastic import ElasticConfig
from zoo.models.heads import TextHead
from zoo.models.kv_cache import KVCache
from zoo.models.ncp import NCP
from zoo.models.nfsp import NFSP
from zoo.tokenizers.vocab import UnifiedVocab


class DecodingModel(Protocol):
    """The parts of `zoo.models.unified.UnifiedModel` that decode steps and loops read."""

    vocab: UnifiedVocab
    backbone: UnifiedTransformer
    text_embed: nn.Embedding
    text_head: TextHead
    nfsp: NFSP | None
    ncp: NCP | None

    def forward_hidden(
        self,
        batch: GroupBatch,
        cache: KVCache | None = None,
        elastic: ElasticConfig | None = None,
        routing: dict[int, Tensor] | None = None,
        inputs: Tensor | None = None,
        at: Tensor | None = None,
    ) -> BackboneOutput: ...

    def sampling_logits(self, hidden: Tensor) -> Tensor: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...
