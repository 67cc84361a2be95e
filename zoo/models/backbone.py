"""The unified backbone (ERNIE 5.0 section 2): one decoder for every modality, read top to bottom.

Pre-norm blocks with RMSNorm, grouped-query attention through `scaled_dot_product_attention` (or
FlexAttention, `attention_backend = "flex"`, set by `zoo.parallel`) with QK-norm, Uni-RoPE over (t, h, w)
positions, and a feed-forward that is a dense SwiGLU in the first `n_dense_layers` blocks and an
ultra-sparse, modality-agnostic mixture of experts after that.

The attention mask is the group rule of `zoo.batch`: a position sees its own group and all earlier
groups of its document. Nothing here knows which modality a position holds: embedders put vectors
in, heads read vectors out. The one exception is an explicit ablation, off by default: `modality_pools`
(ERNIE 4.5-style modality-isolated routing) restricts each token to its modality's pool of experts.
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from zoo.batch import GroupBatch, Modality, group_attention_mask, group_mask_mod
from zoo.config import Configurable
from zoo.models.elastic import ElasticConfig
from zoo.models.kv_cache import KVCache
from zoo.models.moe import ModalityPools, MoEFeedForward, RouterOutput, SwiGLU


class UniRoPE(nn.Module):
    """Rotary embedding over three axes (Qwen2-VL M-RoPE; ERNIE's Uni-RoPE).

    The `head_dim // 2` rotary frequency pairs are split into contiguous (t, h, w) sections; pair j
    rotates by the position on its section's axis. Text has t = h = w, which makes this exactly the
    ordinary 1D RoPE, so text behaves as in any LLM.
    """

    def __init__(
        self, head_dim: int, theta: float = 10000.0, sections: tuple[int, int, int] | None = None
    ) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim}")
        pairs = head_dim // 2
        if sections is None:
            h = pairs // 4
            sections = (pairs - 2 * h, h, h)
        if sum(sections) != pairs or len(sections) != 3:
            raise ValueError(
                f"rope sections {tuple(sections)} must be three numbers summing to head_dim/2 = {pairs}"
            )
        self.sections = tuple(sections)
        inv_freq = 1.0 / (theta ** (torch.arange(0, pairs, dtype=torch.float64) / pairs))
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        axis = torch.tensor([i for i, n in enumerate(self.sections) for _ in range(n)])
        self.register_buffer("axis_of_pair", axis, persistent=False)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions `[3, B, L]` -> (cos, sin), each `[B, L, head_dim]` in float32."""
        angles = positions.float()[..., None] * self.inv_freq  # [3, B, L, P]
        index = self.axis_of_pair.view(1, 1, 1, -1).expand(1, *angles.shape[1:])
        angles = angles.gather(0, index)[0]  # each pair takes its own axis: [B, L, P]
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x `[B, H, L, Dh]`; cos/sin `[B, L, Dh]`. The rotate-half convention."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    return x * cos + rotated * sin


@dataclass
class AttentionContext:
    """What every block of one forward pass shares: rotary tables, the mask (a dense `[B, 1, Lq, Lk]` bool
    for SDPA, or FlexAttention's `BlockMask` of the same rule), the cache window."""

    cos: Tensor
    sin: Tensor
    mask: Tensor | BlockMask
    cache: KVCache | None = None
    start: int | Tensor = 0  # where this pass's positions go in the cache (a tensor: a static step)

    @property
    def static(self) -> bool:
        """A static step (`UnifiedTransformer.static_context`): no shape may depend on a tensor's value."""
        return isinstance(self.start, Tensor)


class Attention(nn.Module):
    """Grouped-query attention with QK-norm through `scaled_dot_product_attention`."""

    def __init__(
        self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, qk_norm: bool, norm_eps: float
    ):
        super().__init__()
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        # QK-norm keeps attention logits bounded, the usual fix for loss spikes in large MoE runs.
        self.q_norm = nn.RMSNorm(head_dim, eps=norm_eps) if qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(head_dim, eps=norm_eps) if qk_norm else nn.Identity()

    def forward(self, x: Tensor, ctx: AttentionContext, layer: int) -> Tensor:
        b, length, _ = x.shape
        q = self.q_norm(self.wq(x).view(b, length, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.wk(x).view(b, length, self.n_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.wv(x).view(b, length, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, ctx.cos, ctx.sin), apply_rotary(k, ctx.cos, ctx.sin)
        if ctx.cache is not None:
            k, v = ctx.cache.store(layer, ctx.start, k, v)
        gqa = self.n_kv_heads != self.n_heads
        if isinstance(ctx.mask, BlockMask):
            out = _flex_attention(q, k, v, block_mask=ctx.mask, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=ctx.mask, enable_gqa=gqa)
        return self.wo(out.transpose(1, 2).reshape(b, length, -1))


def _flex_attention(q: Tensor, k: Tensor, v: Tensor, block_mask: BlockMask, enable_gqa: bool) -> Tensor:
    """FlexAttention, compiled where the fused kernel exists (CUDA: the eager call materialises every score
    and is only a reference); on the CPU the eager reference runs (no C++ toolchain needed, same values)."""
    if q.is_cuda:
        return _compiled_flex_attention()(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)
    return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)


@functools.cache
def _compiled_flex_attention():  # noqa: ANN202 (a compiled callable)
    return torch.compile(flex_attention, dynamic=False)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + ffn(norm(x)); the FFN is dense or MoE."""

    def __init__(self, attention: Attention, ffn: SwiGLU | MoEFeedForward, dim: int, norm_eps: float) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.attention = attention
        self.ffn_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.ffn = ffn

    @property
    def is_moe(self) -> bool:
        return isinstance(self.ffn, MoEFeedForward)

    def forward(
        self,
        x: Tensor,
        ctx: AttentionContext,
        layer: int,
        valid: Tensor | None = None,
        top_k: int | None = None,
        expert_mask: Tensor | None = None,
        forced_indices: Tensor | None = None,
    ) -> tuple[Tensor, RouterOutput | None]:
        x = x + self.attention(self.attn_norm(x), ctx, layer)
        h = self.ffn_norm(x)
        if not self.is_moe:
            return x + self.ffn(h), None
        # Only real tokens reach the router: padding must not count as load or pull the balance.
        tokens = h.reshape(-1, h.shape[-1]) if valid is None else h[valid]
        # A static step takes the MoE's gathered path at any row count: the sorted one's shapes follow data.
        run = self.ffn.forward_gathered if ctx.static else self.ffn
        moe = run(tokens, top_k=top_k, expert_mask=expert_mask, forced_indices=forced_indices)
        if valid is None:
            return x + moe.out.view_as(x), moe.router
        out = torch.zeros_like(h, dtype=moe.out.dtype)  # under autocast the experts' output may be bf16
        out[valid] = moe.out
        return x + out, moe.router


@dataclass
class BackboneOutput:
    """hidden: `[B, L, D]` after the final norm. router: `(layer index, RouterOutput)` per MoE layer run.
    context: the pass's attention context (MTP blocks reuse its mask and rotary tables)."""

    hidden: Tensor
    router: list[tuple[int, RouterOutput]]
    context: AttentionContext

    @property
    def aux_loss(self) -> Tensor:
        return sum((r.aux_loss for _, r in self.router), self.hidden.new_zeros(()))

    @property
    def z_loss(self) -> Tensor:
        return sum((r.z_loss for _, r in self.router), self.hidden.new_zeros(()))

    @property
    def routing(self) -> dict[int, Tensor]:
        """The expert choices per MoE layer, `[N_valid, k]`: record them to replay them (RL router replay)."""
        return {layer: r.indices for layer, r in self.router}


class UnifiedTransformer(Configurable, nn.Module):
    """The modality-agnostic decoder.

    Args:
        dim: model width.
        n_layers: number of blocks.
        n_heads: query heads.
        n_kv_heads: key/value heads (grouped-query attention); must divide n_heads.
        head_dim: per-head width; defaults to dim // n_heads.
        n_dense_layers: the first blocks use a dense SwiGLU instead of experts (DeepSeek-V3 keeps 3).
        dense_hidden: hidden width of dense SwiGLU layers; defaults to (n_shared + top_k) * expert_hidden.
        n_experts: routed experts per MoE layer (fine-grained: many small experts).
        n_shared_experts: always-on experts per MoE layer (0 for none).
        expert_hidden: hidden width of one expert.
        top_k: experts per token.
        score_func: router scores, "softmax" or "sigmoid" (DeepSeek-V3).
        balancing: "aux_loss", "aux_free" (bias-based, updated by `ExpertBiasUpdate`) or "none".
        aux_loss_coef: weight of the load-balancing loss when balancing == "aux_loss".
        z_loss_coef: weight of the router z-loss (0 disables).
        route_scale: multiplier of the gate weights (DeepSeek-V3 uses 2.5 with sigmoid scores).
        rope_theta: rotary base.
        rope_sections: rotary pairs given to (t, h, w); defaults to half for t, a quarter each for h, w.
        max_seq_len: the longest sequence (training row or prompt plus generation) accepted.
        qk_norm: RMSNorm on queries and keys.
        norm_eps: epsilon of every RMSNorm.
        modality_pools: the modality-isolated routing ablation (ERNIE 4.5): each modality's tokens choose
            only among its pool of routed experts (shared experts stay shared). None (default): the
            modality-agnostic router of ERNIE 5.0, which never sees a modality.
    """

    def __init__(
        self,
        dim: int = 128,
        n_layers: int = 4,
        n_heads: int = 4,
        n_kv_heads: int = 2,
        head_dim: int | None = None,
        n_dense_layers: int = 1,
        dense_hidden: int | None = None,
        n_experts: int = 16,
        n_shared_experts: int = 1,
        expert_hidden: int = 64,
        top_k: int = 4,
        score_func: Literal["softmax", "sigmoid"] = "softmax",
        balancing: Literal["aux_loss", "aux_free", "none"] = "aux_free",
        aux_loss_coef: float = 1e-3,
        z_loss_coef: float = 1e-4,
        route_scale: float = 1.0,
        rope_theta: float = 10000.0,
        rope_sections: tuple[int, int, int] | None = None,
        max_seq_len: int = 1024,
        qk_norm: bool = True,
        norm_eps: float = 1e-6,
        modality_pools: ModalityPools | None = None,
    ) -> None:
        super().__init__()
        if not 0 <= n_dense_layers <= n_layers:
            raise ValueError(f"n_dense_layers must lie in 0..n_layers={n_layers}, got {n_dense_layers}")
        if n_dense_layers < n_layers and not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k must lie in 1..n_experts={n_experts}, got {top_k}")
        head_dim = head_dim or dim // n_heads
        dense_hidden = dense_hidden or (n_shared_experts + top_k) * expert_hidden
        self.dim, self.n_layers, self.n_heads, self.n_kv_heads, self.head_dim = (
            dim,
            n_layers,
            n_heads,
            n_kv_heads,
            head_dim,
        )
        self.n_dense_layers, self.n_experts, self.top_k = n_dense_layers, n_experts, top_k
        self.max_seq_len, self.norm_eps, self.qk_norm = max_seq_len, norm_eps, qk_norm
        self.dense_hidden = dense_hidden
        # How passes without a KV cache attend (a run-time choice, not a model property: `zoo.parallel` sets
        # it from `Parallelism.attention`); cached and static decoding steps always use SDPA.
        self.attention_backend: Literal["sdpa", "flex"] = "sdpa"
        self.rope = UniRoPE(head_dim, rope_theta, rope_sections)
        self.layers = nn.ModuleList()
        for i in range(n_layers):
            if i < n_dense_layers:
                ffn: SwiGLU | MoEFeedForward = SwiGLU(dim, dense_hidden)
            else:
                ffn = MoEFeedForward(
                    dim=dim,
                    n_experts=n_experts,
                    expert_hidden=expert_hidden,
                    top_k=top_k,
                    n_shared_experts=n_shared_experts,
                    score_func=score_func,
                    balancing=balancing,
                    aux_loss_coef=aux_loss_coef,
                    z_loss_coef=z_loss_coef,
                    route_scale=route_scale,
                )
            self.layers.append(self.make_block(ffn))
        self.norm = nn.RMSNorm(dim, eps=norm_eps)
        self.modality_pools: ModalityPools | None = None
        self.set_modality_pools(modality_pools)
        self.reset_parameters()

    def set_modality_pools(self, pools: ModalityPools | None) -> None:
        """Turn modality-isolated routing on (checked against n_experts and top_k) or off (None)."""
        if pools is not None:
            if self.n_dense_layers == self.n_layers:
                raise ValueError("modality_pools needs MoE layers, but every layer is dense (n_dense_layers)")
            pools.check(self.n_experts, self.top_k)
        self.modality_pools = pools
        pool_of = None if pools is None else pools.pool_of_expert(self.n_experts)
        for block in self.layers:
            if block.is_moe:
                block.ffn.router.set_pools(pool_of)

    def pool_mask(self, batch: GroupBatch, valid: Tensor | None) -> Tensor | None:
        """`[N_valid, E]` bool: the experts each routed token may choose (None unless modality_pools)."""
        if self.modality_pools is None:
            return None
        modality = batch.modality.reshape(-1) if valid is None else batch.modality[valid]
        table = self.modality_pools.table(self.n_experts, len(Modality)).to(modality.device)
        mask = table[modality]
        if modality.numel() and not bool(mask.any(dim=-1).all()):
            missing = sorted({Modality(int(m)).name for m in modality[~mask.any(dim=-1)].unique()})
            raise ValueError(
                f"modality_pools gives no experts to {', '.join(missing)} tokens found in the batch: "
                "give that modality a pool"
            )
        return mask

    def make_block(self, ffn: SwiGLU | MoEFeedForward) -> TransformerBlock:
        """A block with this backbone's attention shape (MTP modules reuse it)."""
        attention = Attention(
            self.dim, self.n_heads, self.n_kv_heads, self.head_dim, self.qk_norm, self.norm_eps
        )
        return TransformerBlock(attention, ffn, self.dim, self.norm_eps)

    def reset_parameters(self) -> None:
        # GPT-2 / VAR init: N(0, 0.02), residual output projections shrunk by sqrt(2 * depth).
        out_std = 0.02 / math.sqrt(2 * self.n_layers)
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue
            is_output = name.endswith(("wo.weight", "w2.weight", ".w2")) or name.split(".")[-1] == "w2"
            nn.init.normal_(p, std=out_std if is_output else 0.02)

    def new_cache(
        self, batch_size: int, max_len: int | None = None, dtype: torch.dtype | None = None
    ) -> KVCache:
        max_len = max_len or self.max_seq_len
        param = next(self.parameters())
        return KVCache(
            self.n_layers,
            batch_size,
            self.n_kv_heads,
            max_len,
            self.head_dim,
            dtype or param.dtype,
            param.device,
        )

    def context(self, batch: GroupBatch, cache: KVCache | None = None) -> AttentionContext:
        """Rotary tables and the group mask for this pass (its positions appended to `cache` when given)."""
        cos, sin = self.rope(batch.positions)
        if cache is None:
            if batch.seq_len > self.max_seq_len:
                raise ValueError(f"sequence of length {batch.seq_len} exceeds max_seq_len={self.max_seq_len}")
            if self.attention_backend == "flex":
                if torch.is_grad_enabled() and batch.doc_id.device.type == "cpu":
                    raise ValueError(
                        "attention_backend='flex' (Parallelism(attention='flex')) cannot train on the CPU: "
                        "FlexAttention has no CPU backward in this torch; use attention='sdpa' on the CPU"
                    )
                return AttentionContext(cos, sin, self.block_mask(batch))
            return AttentionContext(cos, sin, batch.attention_mask())
        start = cache.extend(batch.doc_id, batch.group_id)
        mask = group_attention_mask(
            batch.doc_id, batch.group_id, cache.doc_id, cache.group_id, query_offset=start
        )
        return AttentionContext(cos, sin, mask, cache, start)

    @staticmethod
    def block_mask(batch: GroupBatch) -> BlockMask:
        """The group rule of `batch` as FlexAttention's `BlockMask`: built once per pass from doc and group
        ids (`zoo.batch.group_mask_mod`), shared by every layer; blocks of 128 x 128 positions no query sees
        (other documents, later groups) are skipped, and no `[L, L]` tensor exists."""
        b, length = batch.doc_id.shape
        mask_mod = group_mask_mod(batch.doc_id, batch.group_id)
        return create_block_mask(mask_mod, b, None, length, length, device=batch.doc_id.device)

    def static_context(self, batch: GroupBatch, cache: KVCache, at: Tensor) -> AttentionContext:
        """A static step's context: its `[R, n]` positions go to cache columns `at .. at + n` (`at` a 0-d
        tensor, the columns `cache.reserve`d) and attend over the cache's whole width, the group rule
        masking the columns not written yet, so no shape depends on how far decoding is. Every position
        of a step is real (one document a row, `zoo.models.decode.step_batch`): the group rule then lets
        each see itself, as `group_attention_mask` does."""
        cos, sin = self.rope(batch.positions)
        columns = at + torch.arange(batch.seq_len, device=at.device)
        cache.write_ids(columns, batch.doc_id, batch.group_id)
        written = torch.arange(cache.max_len, device=at.device) <= columns[-1]
        same_doc = batch.doc_id[:, :, None] == cache.all_doc_id[:, None, :]
        earlier_group = cache.all_group_id[:, None, :] <= batch.group_id[:, :, None]
        mask = (same_doc & earlier_group & written)[:, None]
        return AttentionContext(cos, sin, mask, cache, at)

    def forward(
        self,
        embeddings: Tensor,
        batch: GroupBatch,
        elastic: ElasticConfig | None = None,
        cache: KVCache | None = None,
        routing: dict[int, Tensor] | None = None,
        at: Tensor | None = None,
    ) -> BackboneOutput:
        """Run the (sub-)model on `[B, L, D]` embeddings laid out as `batch` says.

        elastic: run only some layers / experts / a smaller top-k. cache: append to a KV cache.
        routing: replay recorded expert sets per MoE layer (gate weights still come from the router).
        at: a static step (`static_context`): the cache column of the first position, as a 0-d tensor;
        every position is real, so nothing here reads a tensor's value (a compiled step has no graph break).
        """
        if at is not None:
            if cache is None:
                raise ValueError("a static step (at=...) writes into a KV cache: pass cache")
            ctx, valid = self.static_context(batch, cache, at), None
        else:
            ctx, valid = self.context(batch, cache), batch.valid
            valid = None if bool(valid.all()) else valid
        layers = range(self.n_layers) if elastic is None or elastic.layers is None else elastic.layers
        top_k = None if elastic is None else elastic.top_k
        expert_mask = None if elastic is None else elastic.expert_mask(self.n_experts, embeddings.device)
        pools = self.pool_mask(batch, valid)
        if pools is not None:  # isolated routing: a per-token [N, E] mask, within the elastic width
            expert_mask = pools if expert_mask is None else pools & expert_mask
        x, router = embeddings, []
        for i in layers:
            forced = None if routing is None else routing.get(i)
            x, r = self.layers[i](x, ctx, i, valid, top_k, expert_mask, forced)
            if r is not None:
                router.append((i, r))
        return BackboneOutput(self.norm(x), router, ctx)

    def extract(self, config: ElasticConfig) -> UnifiedTransformer:
        """A standalone backbone holding only the sub-model `config` selects (layers and experts removed).

        Its outputs equal `self(..., elastic=config)`. Dense layers come first in both, so the kept dense
        layers stay in front.
        """
        layers = list(range(self.n_layers)) if config.layers is None else list(config.layers)
        if max(layers) >= self.n_layers:
            raise ValueError(f"layer index {max(layers)} out of range for {self.n_layers} layers")
        experts = list(range(self.n_experts)) if config.experts is None else list(config.experts)
        top_k = config.top_k or min(self.top_k, len(experts))
        kept = nn.ModuleList()
        for i in layers:
            block = self.layers[i]
            if block.is_moe:
                # Copy the block without its experts, then give it the extracted layer.
                block = copy.deepcopy(block, memo={id(block.ffn): None})
                block.ffn = self.layers[i].ffn.extract(experts, top_k)
            else:
                block = copy.deepcopy(block)
            kept.append(block)
        # The memo swaps the layer list for the kept one, so no dropped layer is ever copied.
        small = copy.deepcopy(self, memo={id(self.layers): kept})
        small.n_layers = len(layers)
        small.n_dense_layers = sum(1 for i in layers if i < self.n_dense_layers)
        small.n_experts, small.top_k = len(experts), top_k
        if self.modality_pools is not None:
            small.set_modality_pools(self.modality_pools.remap(experts))
        # The sub-model's own constructor arguments: it rebuilds from them alone (hub, export).
        small.init_args = {
            **self.init_args,
            "n_layers": small.n_layers,
            "n_dense_layers": small.n_dense_layers,
            "n_experts": small.n_experts,
            "top_k": top_k,
            "dense_hidden": self.dense_hidden,
            "modality_pools": small.modality_pools,
        }
        return small
