"""The unified model: embedders in, one backbone, heads out (DESIGN.md, "everything is a group").

The model sums each modality's embeddings into one `[B, L, D]` tensor, runs the backbone once and
gives every head the hidden states. Text is the first modality; vision and audio add an embedder
and a head each without touching the backbone.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from zoo.batch import GroupBatch, Modality
from zoo.config import Configurable
from zoo.models.backbone import BackboneOutput, UnifiedTransformer
from zoo.models.elastic import ElasticConfig
from zoo.models.generation import generate_text
from zoo.models.heads import HeadOutput, TextHead
from zoo.models.moe import SwiGLU
from zoo.tokenizers.vocab import UnifiedVocab


@dataclass
class ModelOutput:
    """loss: heads plus router losses. heads: per head name. backbone: hidden states and router outputs."""

    loss: Tensor
    heads: dict[str, HeadOutput]
    backbone: BackboneOutput


class UnifiedModel(Configurable, nn.Module):
    """Text embedder + `UnifiedTransformer` + text head (NTP and MTP).

    Args:
        backbone: the decoder; its width sets the embedders' and heads' width.
        vocab: the unified token space; the text embedder and head cover its specials and text ids.
        mtp_depth: sequential MTP modules (0 disables MTP).
        mtp_loss_weight: lambda of the MTP loss.
        tie_embeddings: share the text embedding and output matrices.
    """

    def __init__(
        self,
        backbone: UnifiedTransformer,
        vocab: UnifiedVocab = UnifiedVocab(),
        mtp_depth: int = 1,
        mtp_loss_weight: float = 0.3,
        tie_embeddings: bool = False,
    ) -> None:
        super().__init__()
        if mtp_depth < 0:
            raise ValueError(f"mtp_depth must be >= 0, got {mtp_depth}")
        self.vocab = vocab
        self.backbone = backbone
        dim = backbone.dim
        self.text_embed = nn.Embedding(vocab.text_head_size, dim)
        mtp_blocks = [backbone.make_block(SwiGLU(dim, backbone.dense_hidden)) for _ in range(mtp_depth)]
        self.text_head = TextHead(dim, vocab.text_head_size, mtp_blocks, mtp_loss_weight)
        nn.init.normal_(self.text_embed.weight, std=0.02)
        nn.init.normal_(self.text_head.output.weight, std=0.02)
        for module in self.text_head.mtp:
            for p in module.parameters():
                if p.dim() >= 2:
                    nn.init.normal_(p, std=0.02)
        if tie_embeddings:
            self.text_head.output.weight = self.text_embed.weight

    def embed(self, batch: GroupBatch) -> Tensor:
        """`[B, L, D]`: every modality's embedder writes its own positions."""
        text = batch.modality == Modality.TEXT
        ids = torch.where(text, batch.input_ids, self.vocab.pad_id)
        return self.text_embed(ids)

    def forward(
        self,
        batch: GroupBatch,
        elastic: ElasticConfig | None = None,
        routing: dict[int, Tensor] | None = None,
    ) -> ModelOutput:
        out = self.backbone(self.embed(batch), batch, elastic=elastic, routing=routing)
        heads = {"text": self.text_head(out.hidden, batch, out.context, self.text_embed)}
        loss = sum((h.loss for h in heads.values()), out.aux_loss + out.z_loss)
        return ModelOutput(loss, heads, out)

    def extract(self, config: ElasticConfig) -> UnifiedModel:
        """A standalone model of the sub-model `config` selects; embedders and heads are kept whole."""
        # The memo hands deepcopy the extracted backbone: the full one is never copied.
        return copy.deepcopy(self, memo={id(self.backbone): self.backbone.extract(config)})

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        elastic: ElasticConfig | None = None,
        use_cache: bool = True,
        stop_ids: tuple[int, ...] | None = None,
        generator: torch.Generator | None = None,
    ) -> list[list[int]]:
        """Sample text continuations of unified-id prompts; see `zoo.models.generation.generate_text`."""
        return generate_text(
            self, prompts, max_new_tokens, temperature, top_k, top_p, elastic, use_cache, stop_ids, generator
        )

    def num_parameters(self, active: bool = False) -> int:
        """Total parameters, or those one token uses (top-k routed plus shared experts, all else)."""
        total = sum(p.numel() for p in self.parameters())
        if not active:
            return total
        inactive = 0
        for block in self.backbone.layers:
            if block.is_moe:
                experts = block.ffn.experts
                per_expert = sum(p.numel() for p in experts.parameters()) // self.backbone.n_experts
                inactive += per_expert * (self.backbone.n_experts - self.backbone.top_k)
        return total - inactive
