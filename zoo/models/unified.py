"""The unified model: embedders in, one backbone, heads out (DESIGN.md, "everything is a group").

The model writes each modality's embeddings into one `[B, L, D]` tensor, runs the backbone once and
gives every head the hidden states. Text is always there; each other modality is one optional,
swappable component: a visual tokenizer turns on NFSP (images and video, `zoo.models.nfsp`), an audio
codec turns on NCP (`zoo.models.ncp`), a vision encoder turns on context images (understanding). The
backbone never sees which modality a position came from.
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
from zoo.models.generation import TextStepKind, generate_text
from zoo.models.heads import HeadOutput, TextHead
from zoo.models.kv_cache import KVCache
from zoo.models.moe import SwiGLU
from zoo.models.ncp import NCP
from zoo.models.nfsp import NFSP, VisualCodes
from zoo.models.vision import DualPathEncoder
from zoo.tokenizers.audio import AudioCodec
from zoo.tokenizers.visual import VisualTokenizer
from zoo.tokenizers.vocab import UnifiedVocab


@dataclass
class MediaInputs:
    """What the frozen tokenizers and the encoder make of a batch's media, computed once per forward."""

    visual: VisualCodes | None = None
    audio: Tensor | None = None  # [N_frames, Q] codes
    context: Tensor | None = None  # [N_context_tokens, D] embeddings


@dataclass
class ModelOutput:
    """loss: heads plus router losses. heads: per head name. backbone: hidden states and router outputs."""

    loss: Tensor
    heads: dict[str, HeadOutput]
    backbone: BackboneOutput


class UnifiedModel(Configurable, nn.Module):
    """Embedders + `UnifiedTransformer` + heads: text always, vision and audio when their tokenizers are set.

    Args:
        backbone: the decoder; its width sets the embedders' and heads' width.
        vocab: the unified token space; the text embedder and head cover its specials and text ids.
        mtp_depth: sequential MTP modules (0 disables MTP).
        mtp_loss_weight: lambda of the MTP loss.
        tie_embeddings: share the text embedding and output matrices.
        visual_tokenizer: a trained multi-scale visual tokenizer (frozen here): enables NFSP image and
            video generation and understanding from codes. Its codebook must fit `vocab.visual_size`.
        audio_codec: a trained RVQ codec (frozen here): enables NCP audio generation and understanding.
        vision_encoder: a dual-path encoder for context images (trained with the model unless frozen).
        ncp_depth_layers: layers of the NCP depth transformer.
        visual_loss_weight: weight of the NFSP loss.
        audio_loss_weight: weight of the NCP loss.
        freeze_vision_encoder: keep the vision encoder as it was loaded (no gradient, always in eval mode),
            like the tokenizers. For a pretrained encoder under a short budget: trained on at the
            backbone's learning rate, its batch norms see the 2-3 context images of a step, and it drifted
            into one constant token for every image within 450 steps (docs/results.md).
    """

    def __init__(
        self,
        backbone: UnifiedTransformer,
        vocab: UnifiedVocab = UnifiedVocab(),
        mtp_depth: int = 1,
        mtp_loss_weight: float = 0.3,
        tie_embeddings: bool = False,
        visual_tokenizer: VisualTokenizer | None = None,
        audio_codec: AudioCodec | None = None,
        vision_encoder: DualPathEncoder | None = None,
        ncp_depth_layers: int = 2,
        visual_loss_weight: float = 1.0,
        audio_loss_weight: float = 1.0,
        freeze_vision_encoder: bool = False,
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
        self.nfsp: NFSP | None = None
        if visual_tokenizer is not None:
            if visual_tokenizer.codebook_size > vocab.visual_size:
                raise ValueError(
                    f"the visual tokenizer has {visual_tokenizer.codebook_size} codes but the unified "
                    f"vocabulary reserves visual_size={vocab.visual_size}"
                )
            self.nfsp = NFSP(visual_tokenizer, dim, visual_loss_weight)
        self.ncp: NCP | None = None
        if audio_codec is not None:
            self.ncp = NCP(audio_codec, vocab, dim, ncp_depth_layers, loss_weight=audio_loss_weight)
        self.vision_encoder = vision_encoder
        self.freeze_vision_encoder = freeze_vision_encoder and vision_encoder is not None
        if self.freeze_vision_encoder:
            vision_encoder.requires_grad_(False).eval()
        self.context_proj: nn.Module | None = None
        self.context_norm: nn.RMSNorm | None = None
        if vision_encoder is not None:
            out_dim = vision_encoder.out_dim
            self.context_proj = nn.Identity() if out_dim == dim else nn.Linear(out_dim, dim, bias=False)
            # The encoder's tokens enter the residual stream at unit RMS. Unnormalised they grow to hundreds
            # (measured: RMS ~40 after 900 steps), and under pre-norm blocks a huge residual both drowns
            # what the blocks add at those positions and divides the gradient reaching the encoder by its
            # size, so image to caption never learned from the context path.
            self.context_norm = nn.RMSNorm(dim, eps=backbone.norm_eps)
        self.ncp_depth_layers = ncp_depth_layers
        self.visual_loss_weight, self.audio_loss_weight = visual_loss_weight, audio_loss_weight
        # How many text ids the tokenizer in use defines (`decode_text_with`); None: all of vocab.text_size.
        self.decodable_text_ids: int | None = None

    def decode_text_with(self, tokenizer_size: int | None) -> None:
        """Generate only text ids a tokenizer of `tokenizer_size` ids can decode: the vocabulary may reserve
        more (`vocab.text_size`), and an untrained id sampled by chance decodes as U+2047. None lifts it."""
        if tokenizer_size is not None and not 0 < tokenizer_size <= self.vocab.text_size:
            raise ValueError(f"tokenizer_size must lie in 1..{self.vocab.text_size}, got {tokenizer_size}")
        self.decodable_text_ids = tokenizer_size

    def sampling_logits(self, hidden: Tensor) -> Tensor:
        """The text head's logits for generation, with the ids the tokenizer cannot decode at -inf."""
        logits = self.text_head.logits(hidden)
        if self.decodable_text_ids is None or self.decodable_text_ids == self.vocab.text_size:
            return logits
        start = self.vocab.text_offset + self.decodable_text_ids
        unused = torch.arange(start, self.vocab.visual_offset, device=logits.device)
        return logits.index_fill(-1, unused, -torch.inf)

    # The frozen tokenizers live inside their heads; these give them back under their argument names
    # (configuration records and `zoo.config.to_config` read them).
    @property
    def visual_tokenizer(self) -> VisualTokenizer | None:
        return None if self.nfsp is None else self.nfsp.tokenizer

    @property
    def audio_codec(self) -> AudioCodec | None:
        return None if self.ncp is None else self.ncp.codec

    def train(self, mode: bool = True) -> UnifiedModel:
        super().train(mode)
        if self.freeze_vision_encoder:
            self.vision_encoder.eval()  # its batch-norm statistics stay the loaded ones
        return self

    def encode_media(self, batch: GroupBatch) -> MediaInputs:
        """Tokenize / encode the media a batch carries (pixels, waveforms), once per forward."""
        media = MediaInputs()
        if batch.visual is not None:
            if self.nfsp is None:
                raise ValueError("the batch holds visual groups but the model has no visual_tokenizer")
            media.visual = self.nfsp.encode(batch.visual)
        if batch.audio is not None:
            if self.ncp is None:
                raise ValueError("the batch holds audio groups but the model has no audio_codec")
            media.audio = self.ncp.encode(batch.audio)
        if batch.context is not None:
            if self.vision_encoder is None:
                raise ValueError("the batch holds context images but the model has no vision_encoder")
            grid = tuple(batch.context.grid)
            if grid != tuple(self.vision_encoder.grid):
                raise ValueError(
                    f"the batch lays out {grid} context tokens per image but the vision encoder makes "
                    f"{tuple(self.vision_encoder.grid)}: set the datamodule's layout.context_grid"
                )
            tokens = self.vision_encoder(batch.context.pixels)
            media.context = self.context_norm(self.context_proj(tokens.flatten(0, 1)))
        return media

    def embed(self, batch: GroupBatch, media: MediaInputs | None = None) -> Tensor:
        """`[B, L, D]`: every modality's embedder writes its own positions."""
        text = batch.modality == Modality.TEXT
        ids = torch.where(text, batch.input_ids, self.vocab.pad_id)
        x = self.text_embed(ids)
        if not batch.has_media:
            return x
        media = media or self.encode_media(batch)
        if media.visual is not None:
            x = self.nfsp.embed(x, batch.visual, media.visual)
        if media.audio is not None:
            x = self.ncp.embed(x, batch.audio, media.audio)
        if media.context is not None:
            slot = batch.context.slot
            where = slot >= 0
            x = x.masked_scatter(where[..., None], media.context[slot[where]].to(x.dtype))
        return x

    def forward_hidden(
        self,
        batch: GroupBatch,
        cache: KVCache | None = None,
        elastic: ElasticConfig | None = None,
        routing: dict[int, Tensor] | None = None,
        inputs: Tensor | None = None,
        media: MediaInputs | None = None,
        at: Tensor | None = None,
    ) -> BackboneOutput:
        """The backbone's pass over `batch`: every caller's way in (training, prefill, decode steps, RL).

        cache: append these positions to a KV cache (decoding). elastic: run a sub-model. routing: replay
        recorded expert sets (RL router replay). inputs: `[B, L, D]` embeddings the caller made itself,
        instead of `embed(batch, media)` (a decode step of visual or audio positions embeds its codes).
        at: a static step's first cache column as a 0-d tensor (`zoo.models.static_step`).
        """
        x = self.embed(batch, media) if inputs is None else inputs
        return self.backbone(x, batch, elastic=elastic, cache=cache, routing=routing, at=at)

    def forward(
        self,
        batch: GroupBatch,
        elastic: ElasticConfig | None = None,
        routing: dict[int, Tensor] | None = None,
    ) -> ModelOutput:
        media = self.encode_media(batch)
        out = self.forward_hidden(batch, elastic=elastic, routing=routing, media=media)
        heads = {"text": self.text_head(out.hidden, batch, out.context, self.text_embed)}
        if media.visual is not None:
            heads["visual"] = self.nfsp(out.hidden, batch, media.visual)
        if media.audio is not None:
            heads["audio"] = self.ncp(out.hidden, batch, media.audio)
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
        step: TextStepKind = "dynamic",
    ) -> list[list[int]]:
        """Sample text continuations of unified-id prompts; see `zoo.models.generation.generate_text`
        (`step="compiled"`: the static, compiled text step)."""
        return generate_text(
            self,
            prompts,
            max_new_tokens,
            temperature,
            top_k,
            top_p,
            elastic,
            use_cache,
            stop_ids,
            generator,
            step,
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
