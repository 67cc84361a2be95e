"""Output heads. The text head: next-token prediction plus DeepSeek-V3 sequential Multi-Token Prediction.

ERNIE 5.0 applies MTP to text only. MTP module k (1-based) predicts the token k+1 steps ahead:

    h^k_i = Block_k( W_k [ RMSNorm(h^{k-1}_i) ; RMSNorm(Emb(t_{i+k})) ] ),   logits = Head(h^k_i)

with h^0 the backbone output, the embedding and output head shared with the main model, and the
loss  L_MTP = lambda * mean_k CE_k  (lambda 0.3 early in DeepSeek-V3, 0.1 later). The same modules
draft tokens for speculative self-decoding (`zoo.models.generation`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zoo.batch import IGNORE_INDEX, GroupBatch
from zoo.models.backbone import AttentionContext, TransformerBlock


@dataclass
class HeadOutput:
    """loss: the head's total weighted loss (scalar). metrics: named scalars for logging (detached)."""

    loss: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)


class MTPModule(nn.Module):
    """One sequential MTP depth: merge the previous depth's state with the next token's embedding."""

    def __init__(self, dim: int, block: TransformerBlock, norm_eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.embed_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.proj = nn.Linear(2 * dim, dim, bias=False)
        self.block = block
        self.out_norm = nn.RMSNorm(dim, eps=norm_eps)

    def forward(self, hidden: Tensor, next_embedding: Tensor, ctx: AttentionContext) -> Tensor:
        x = self.proj(torch.cat([self.hidden_norm(hidden), self.embed_norm(next_embedding)], dim=-1))
        x, _ = self.block(x, ctx, layer=0)
        return self.out_norm(x)


def shift_left(x: Tensor, steps: int, fill: int) -> Tensor:
    """`out[:, i] = x[:, i + steps]`, `fill` past the end of the row."""
    if steps == 0:
        return x
    out = torch.full_like(x, fill)
    out[:, :-steps] = x[:, steps:]
    return out


class TextHead(nn.Module):
    """Next-token prediction over the text-head vocabulary (specials + text) plus sequential MTP.

    Args:
        dim: backbone width.
        vocab_size: outputs (`UnifiedVocab.text_head_size`).
        mtp_blocks: one transformer block per MTP depth (empty: no MTP).
        mtp_loss_weight: lambda in L = L_NTP + lambda * mean_k L_MTP_k.
    """

    def __init__(
        self, dim: int, vocab_size: int, mtp_blocks: list[TransformerBlock], mtp_loss_weight: float = 0.3
    ):
        super().__init__()
        self.vocab_size = vocab_size
        self.output = nn.Linear(dim, vocab_size, bias=False)
        self.mtp = nn.ModuleList(MTPModule(dim, block) for block in mtp_blocks)
        self.mtp_loss_weight = mtp_loss_weight

    @property
    def mtp_depth(self) -> int:
        return len(self.mtp)

    def logits(self, hidden: Tensor) -> Tensor:
        return self.output(hidden)

    def forward(
        self, hidden: Tensor, batch: GroupBatch, ctx: AttentionContext, embed: nn.Embedding
    ) -> HeadOutput:
        """Cross-entropy at the positions whose `targets["text"]` is set (text positions only)."""
        targets = batch.targets["text"]
        picked = targets != IGNORE_INDEX
        n = picked.sum()
        if int(n) == 0:
            zero = hidden.sum() * 0.0  # keeps the graph connected when a batch has no text
            return HeadOutput(zero, {"text/ntp_loss": zero.detach(), "text/tokens": n.float()})
        logits = self.logits(hidden[picked])
        ntp = F.cross_entropy(logits.float(), targets[picked])
        accuracy = (logits.argmax(-1) == targets[picked]).float().mean()
        metrics = {
            "text/ntp_loss": ntp.detach(),
            "text/accuracy": accuracy.detach(),
            "text/tokens": n.float(),
        }
        loss = ntp
        if self.mtp_depth:
            mtp_losses = []
            state = hidden
            for k, module in enumerate(self.mtp, start=1):
                # Depth k at position i reads t_{i+k} (the target at i+k-1) and predicts t_{i+k+1} (at i+k).
                # Both must exist and stay in the document, which the ignore markers at document ends ensure.
                next_tokens = shift_left(targets, k - 1, IGNORE_INDEX)
                mtp_targets = shift_left(targets, k, IGNORE_INDEX)
                chain = picked.clone()
                for j in range(1, k + 1):
                    chain &= shift_left(targets, j, IGNORE_INDEX) != IGNORE_INDEX
                    chain &= shift_left(batch.doc_id, j, -2) == batch.doc_id
                state = module(state, embed(next_tokens.clamp_min(0)), ctx)
                if int(chain.sum()) == 0:
                    mtp_losses.append(state.sum() * 0.0)
                    continue
                ce = F.cross_entropy(self.logits(state[chain]).float(), mtp_targets[chain])
                mtp_losses.append(ce)
                metrics[f"text/mtp{k}_loss"] = ce.detach()
            mtp = torch.stack(mtp_losses).mean()
            loss = loss + self.mtp_loss_weight * mtp
        return HeadOutput(loss, metrics)
