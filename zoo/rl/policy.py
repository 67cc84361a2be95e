"""The inference engine's own copy of the policy: built plain, cast to the engine's precision, synced.

ERNIE 5.0 (RL section) generates with a separate inference engine whose numerics differ from the
trainer's (REFERENCES.md part B, section 2). `PolicyCopy` is that engine's weights: a `UnifiedModel`
without FSDP2 shards, FP8 training layers or activation-checkpoint wrappers, in eval mode and without
gradients, in one of three precisions:

- "float32": the trainer's numerics (the engine's log-probs are the trainer's);
- "bfloat16": parameters in bf16 (the KV cache follows them); buffers (rotary frequencies, the aux-free
  expert bias) and the frozen visual tokenizer and audio codec stay float32;
- "fp8": FP8-eligible linears (`zoo.parallel.fp8_module_filter`) and every routed expert rounded through
  float8_e4m3fn with one scale per tensor (per expert); router gates, embeddings, norms and the output head
  stay float32, as in FP8 training.

`sync` copies the trained weights again (gathering FSDP2 shards: every rank calls it) and re-casts them.
"""

from __future__ import annotations

import copy
from typing import Literal

import torch
from torch import Tensor

from zoo.models.unified import UnifiedModel
from zoo.parallel import fp8_module_filter, full_state_dict, is_sharded

Precision = Literal["float32", "bfloat16", "fp8"]
_FP8_MAX = 448.0  # largest finite float8_e4m3fn


def fp8_round_trip(weight: Tensor) -> Tensor:
    """`weight` quantised to float8_e4m3fn with one scale per tensor (amax -> 448) and back."""
    scale = weight.abs().amax().float().clamp_min(1e-12) / _FP8_MAX
    return ((weight.float() / scale).to(torch.float8_e4m3fn).float() * scale).to(weight.dtype)


def plain_copy(model: UnifiedModel) -> UnifiedModel:
    """A float32 UnifiedModel with `model`'s weights and no FSDP / FP8 / checkpoint wrappers."""
    wrapped = is_sharded(model) or any(
        type(m).__name__ in ("Float8Linear", "CheckpointWrapper") for m in model.modules()
    )
    if not wrapped:
        return copy.deepcopy(model).float()
    from zoo.config import to_config
    from zoo.hub import build_from_config

    config = to_config(model)
    config["class_path"] = "zoo.models.unified.UnifiedModel"  # FSDP2 renames the class
    plain = build_from_config(config)
    plain.load_state_dict(full_state_dict(model), strict=True)
    plain.decode_text_with(model.decodable_text_ids)  # generation samples what the trainer's model would
    return plain


class PolicyCopy:
    """A private copy of the policy in the engine's precision (see the module docstring).

    Args:
        model: the trained UnifiedModel (never shared: copied).
        precision: "float32", "bfloat16" or "fp8" (emulated).
    """

    def __init__(self, model: UnifiedModel, precision: Precision = "float32") -> None:
        if precision not in ("float32", "bfloat16", "fp8"):
            raise ValueError(f"precision={precision!r}: expected 'float32', 'bfloat16' or 'fp8'")
        self.precision = precision
        self.model = plain_copy(model).eval().requires_grad_(False)
        self._fp8 = self._fp8_weights() if precision == "fp8" else []
        self._cast()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def sync(self, model: UnifiedModel) -> None:
        """Copy `model`'s weights (FSDP2-sharded ones are gathered: call on every rank) and cast them."""
        self.load(full_state_dict(model))

    @torch.no_grad()
    def load(self, state: dict[str, Tensor]) -> None:
        """Load a plain state dict (`full_state_dict` of the trained model; strict) and cast it: how an
        engine in another process (a Ray actor) gets new weights."""
        self.model.load_state_dict(state, strict=True)
        self._cast()

    def _fp8_weights(self) -> list[Tensor]:
        admit = fp8_module_filter(self.model)
        weights = [m.weight for name, m in self.model.named_modules() if admit(m, name)]
        for block in self.model.backbone.layers:
            if block.is_moe:
                experts = block.ffn.experts
                weights += [experts.w1, experts.w3, experts.w2]
        return weights

    @torch.no_grad()
    def _cast(self) -> None:
        model = self.model
        if self.precision == "bfloat16":
            # Parameters only: buffers (rotary frequencies, the aux-free expert bias) stay float32. The
            # frozen media tokenizers stay float32 too: they are not the policy, and media prompts must
            # become the codes the trainer sees (their quantisers are not written for bf16 either).
            frozen = {id(p) for m in (model.visual_tokenizer, model.audio_codec) if m is not None
                      for p in m.parameters()}  # fmt: skip
            for p in model.parameters():
                if id(p) not in frozen:
                    p.data = p.data.to(torch.bfloat16)
        elif self.precision == "fp8":
            for w in self._fp8:
                # Stacked experts get one scale each: a per-tensor scale over all of them is too coarse.
                w.copy_(torch.stack([fp8_round_trip(e) for e in w]) if w.dim() == 3 else fp8_round_trip(w))
