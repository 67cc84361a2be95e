"""FP8 training of the routed experts' grouped GEMMs through torchao's MoE training path (issue 17, item 6).

torchao 0.17 ships it as a prototype, `torchao.prototype.moe_training`: `Float8TrainingOpConfig` (FP8
rowwise: e4m3 with one scale per row of each operand) and a weight wrapper tensor,
`Float8TrainingWeightWrapperTensor`, that turns `torch._grouped_mm(x, w, offs=...)` on a wrapped 3D weight
into dynamic quantisation plus `torch._scaled_grouped_mm`, forward and backward, and keeps FSDP2's
all-gather working (its `fsdp_pre/post_all_gather` hooks). Its kernels are CUDA only (SM90, H100/H200:
there is no CPU `_scaled_grouped_mm`, and MXFP8, the SM100 recipe, needs a torch nightly), so on any other
device `convert_experts_to_float8` refuses with the reason.

Two requirements of torchao's kernel that the zoo's experts do not meet as they are, handled by the
zoo's own wrapper subclass (`ExpertFloat8Weight`) at the grouped GEMM:
- the weight must be column-major per expert (strides (K*N, 1, K)); the zoo stores w1, w3 [E, D, H] and
  w2 [E, H, D] row-major (so the state dict and checkpoints stay what they are), so the bf16 weight is laid
  out column-major once per call, where the FP8 cast reads it anyway;
- every expert's row count must be a multiple of 16 (the FP8 GEMM's tile), and torchao 0.17 refuses to pad
  (`pad_token_groups_for_grouped_mm=True is not yet supported`): `pad_groups` spreads the rows into groups
  padded with zero rows, without a host sync, and the product is gathered back.
The router, shared experts, embeddings and heads are untouched (`Parallelism.fp8` covers the linears).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from zoo.models.moe import Experts

FP8_GROUP_ROWS = 16  # the FP8 grouped GEMM's row tile: each expert's rows padded to a multiple
FP8_DIM_MULTIPLE = 16  # both dimensions of each expert's weight (the scaled-mm kernels' constraint)
MIN_CAPABILITY = (9, 0)  # torch._scaled_grouped_mm's FP8 rowwise kernel: Hopper (H100, H200) and later


def fp8_experts_unavailable(device_type: str | None = None) -> str | None:
    """Why FP8 experts cannot run here (None when they can): torchao's MoE path, a CUDA GPU of compute
    capability 9.0+, and (when known) a CUDA device for the model."""
    try:
        import torchao.prototype.moe_training.tensor  # noqa: F401
    except ImportError as err:
        return f"torchao has no MoE training path (torchao.prototype.moe_training): {err}"
    if device_type is not None and device_type != "cuda":
        return f"the model runs on {device_type!r}; torchao's FP8 grouped GEMM is CUDA only"
    if not torch.cuda.is_available():
        return "no CUDA GPU: torch._scaled_grouped_mm (torchao's FP8 grouped GEMM) has no CPU kernel"
    capability = torch.cuda.get_device_capability()
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name()
        return f"{name} is compute capability {capability}; the FP8 grouped GEMM needs {MIN_CAPABILITY}+"
    return None


def pad_groups(x: Tensor, offsets: Tensor, multiple: int = FP8_GROUP_ROWS) -> tuple[Tensor, Tensor, Tensor]:
    """Rows x [M, K] sorted into groups ending at `offsets` [G] (int32 cumulative counts) -> the same rows
    with each group padded by zero rows to a multiple of `multiple`, the index of each original row in the
    padded tensor, and the padded groups' end offsets. The padded tensor has a fixed size, M + G * multiple
    rows (no host sync); rows after the last group belong to none and are ignored by the grouped GEMM."""
    counts = torch.diff(offsets.long(), prepend=offsets.new_zeros(1).long())
    padded_counts = (counts + multiple - 1) // multiple * multiple
    padded_ends = padded_counts.cumsum(0)
    groups = torch.arange(len(counts), device=x.device)
    group = torch.repeat_interleave(groups, counts, output_size=x.shape[0])
    shift = (padded_ends - padded_counts) - (offsets.long() - counts)  # padded start - start, per group
    rows = torch.arange(x.shape[0], device=x.device) + shift[group]
    padded = x.new_zeros(x.shape[0] + len(counts) * multiple, x.shape[1]).index_copy(0, rows, x)
    return padded, rows, padded_ends.to(torch.int32)


def column_major(w: Tensor) -> Tensor:
    """`w` [E, K, N] with the same values, laid out column-major per expert (strides (K*N, 1, K))."""
    return w.transpose(-2, -1).contiguous().transpose(-2, -1)


def _wrapper_class() -> type:
    """`ExpertFloat8Weight`, defined on first use: torchao is imported only when FP8 experts are asked for."""
    global ExpertFloat8Weight
    if ExpertFloat8Weight is not None:
        return ExpertFloat8Weight
    from torchao.prototype.moe_training.tensor import Float8TrainingWeightWrapperTensor
    from torchao.prototype.moe_training.utils import _quantize_then_scaled_grouped_mm, unwrap_weight

    class _ExpertFloat8Weight(Float8TrainingWeightWrapperTensor):
        """torchao's FP8 weight wrapper, with the zoo's layout (row-major experts) and group sizes (any)
        brought to what its kernel needs; every other op behaves as on the plain weight."""

        @classmethod
        def __torch_function__(cls, func, types, args, kwargs=None):  # noqa: ANN001, ANN206
            kwargs = kwargs or {}
            if func.__name__ != "_grouped_mm":
                return super().__torch_function__(func, types, args, kwargs)
            x, weight, offsets = args[0], args[1], kwargs.get("offs")
            if offsets is None or x.ndim != 2 or isinstance(x, cls) or not isinstance(weight, cls):
                with torch._C.DisableTorchFunctionSubclass():  # not the routed experts' product: as is
                    return func(*args, **kwargs)
            padded, rows, padded_ends = pad_groups(x, offsets)
            # unwrap_weight: differentiable, so the gradient reaches the expert parameter.
            weight_t = column_major(unwrap_weight(weight))
            out = _quantize_then_scaled_grouped_mm(padded, weight_t, config=weight.config, offs=padded_ends)
            return out[rows].to(x.dtype)

    ExpertFloat8Weight = _ExpertFloat8Weight
    return ExpertFloat8Weight


ExpertFloat8Weight: type | None = None


def routed_expert_modules(model: nn.Module) -> list[tuple[str, Experts]]:
    """The routed experts (`zoo.models.moe.Experts`) of `model`, by name."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, Experts)]


def convert_experts_to_float8(model: nn.Module, device_type: str | None = None) -> int:
    """Wrap every routed expert weight (w1, w2, w3 of each `Experts`) for torchao's FP8 rowwise grouped GEMM,
    in place; returns how many weights were wrapped (0 when already done: idempotent). The parameter names
    and shapes stay, so checkpoints and the state dict do not change.

    Raises ValueError naming the reason where the path cannot run (see `fp8_experts_unavailable`), and naming
    the experts whose widths are not multiples of 16."""
    reason = fp8_experts_unavailable(device_type)
    if reason is not None:
        raise ValueError(f"Parallelism(fp8_experts=True) cannot run here: {reason}")
    experts = routed_expert_modules(model)
    odd = [n for n, e in experts if e.dim % FP8_DIM_MULTIPLE or e.hidden % FP8_DIM_MULTIPLE]
    if odd:
        raise ValueError(
            f"FP8 experts need dim and expert_hidden divisible by {FP8_DIM_MULTIPLE}; not so in {odd[:4]}"
        )
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig

    wrapper, config = _wrapper_class(), Float8TrainingOpConfig()
    wrapped = 0
    for _, module in experts:
        for name in ("w1", "w2", "w3"):
            weight = getattr(module, name)
            if not isinstance(weight.data, wrapper):
                setattr(module, name, nn.Parameter(wrapper(weight.data, config), weight.requires_grad))
                wrapped += 1
    return wrapped
