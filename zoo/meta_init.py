"""Meta-device initialisation with exactly the single-process weights (DESIGN.md, "Scale"; torchtitan's
meta-device init, made reproducible).

Under FSDP2 every rank should hold only its shard of the parameters, never the whole model. So the model is
built with its parameters on the `meta` device (no memory), sharded, and only then materialised. torchtitan
materialises with each module's `init_weights()`, which gives *some* deterministic weights; here a run on 64
ranks must start from the very weights a single process builds with the same seed (so a sharded run can be
checked against a small one, and configs mean the same at every scale). The zoo's init is whatever the
constructors do, in construction order, on one CPU random stream; re-deriving that order by hand would break
with every new module. So construction is *recorded*:

- `deferred_init()` patches `nn.Module.register_parameter`: each parameter is moved to `meta` as it is
  registered, keeping the tensor it was created as until a write overwrites it whole (`normal_`, `copy_`:
  then only its shape is kept). Most are `torch.empty`, whose pages stay untouched only until the allocator
  hands out pages a freed tensor touched; keeping them all held a whole model's worth of allocated memory
  (268 MB for `small`, and as much again for an `init_from` source: docs/scale.md). The few created with
  values (`torch.ones(...)`) keep those values. Buffers stay real: they are small and often derived (rotary
  tables), and nothing would replay them.
- A `TorchDispatchMode` records every op that writes a deferred parameter (`normal_`, `uniform_`,
  `fill_`, `zero_`, a `copy_` from loaded weights, writes through views) with the view's geometry. A random
  op also records the generator's state and runs once on a scratch tensor of the same shape, so the stream
  advances exactly as in a real build and the next parameter draws what it would have drawn.
- `materialize(model, plan)` (after `fully_shard`) replays each parameter's ops on a full CPU tensor, one
  parameter at a time, and copies this rank's shard in: the weights equal the single-process build bit for
  bit, and the peak is the shards plus one full parameter. Frozen weights loaded from files inside
  construction (the visual tokenizer's, the audio codec's) are `copy_`s from the loaded tensors, replayed
  like any other write.

A write that reads another deferred parameter (or a view of one) is recorded as reading that parameter's value
at that point: loading a model that was itself built deferred (`init_from` under FSDP2's meta init reads its
source model this way, from memory-mapped files) costs no memory until the replay. What cannot be replayed is
refused with the op and the parameter's shape named: a write from a tensor computed on `meta` (e.g.
`orthogonal_`'s QR, or the mean of a deferred parameter; `value_of` gives a parameter's real value first).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

# torch's activation-checkpoint wrapper inserts this into parameter names.
_CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."


@dataclass
class _Write:
    """One recorded write: `func(view, *args, **kwargs)` where `view` is the parameter's `as_strided` view."""

    func: torch._ops.OpOverload
    geometry: tuple[tuple[int, ...], tuple[int, ...], int]  # size, stride, storage offset of the written view
    args: tuple
    kwargs: dict
    rng_state: Tensor | None = None  # the generator's state before a random op (None: not random)


@dataclass(frozen=True)
class _DeferredRead:
    """A write's input that is (a view of) a deferred parameter: that parameter's value after its first
    `n_writes` writes, seen through the view's geometry (size, stride, storage offset). Resolved at replay."""

    record: ParameterRecord
    n_writes: int
    geometry: tuple[tuple[int, ...], tuple[int, ...], int]

    def resolve(self) -> Tensor:
        return self.record.replay(self.n_writes).as_strided(*self.geometry)


@dataclass
class ParameterRecord:
    """How one parameter came to be: the tensor it was created as (or a copy of another record's value after
    its first n writes: `copy.deepcopy` of a module clones its parameters), then every write to it, in
    order."""

    created: Tensor | tuple[ParameterRecord, int]
    writes: list[_Write] = field(default_factory=list)
    copied: bool = False  # another record starts from this one's value: replay on a copy, never in place

    def replay(self, n_writes: int | None = None) -> Tensor:
        """The parameter's value as a real build would have made it (a full CPU tensor); after its first
        `n_writes` writes when given."""
        if isinstance(self.created, tuple):
            source, upto = self.created
            value = source.replay(upto).clone()
        elif self.created.is_meta:  # its first write overwrites it whole (_OVERWRITING_OPS): any values do
            value = torch.empty_like(self.created, device="cpu")
        else:
            value = self.created.clone() if self.copied else self.created
        for write in self.writes[:n_writes]:
            size, stride, offset = write.geometry
            view = value.as_strided(size, stride, offset)
            args, kwargs = tree_map(_resolved, (write.args, dict(write.kwargs)))
            if write.rng_state is not None:
                generator = torch.Generator()
                generator.set_state(write.rng_state)
                kwargs["generator"] = generator
            with torch.no_grad():
                write.func(view, *args, **kwargs)
        return value


def _resolved(value: object) -> object:
    return value.resolve() if isinstance(value, _DeferredRead) else value


def _storage_key(tensor: Tensor) -> StorageWeakRef:
    return StorageWeakRef(tensor.untyped_storage())


# Every deferred parameter's record, by its meta storage (Parameter objects come and go: deepcopy, FP8
# wrappers, FSDP2; the storage of an unsharded meta parameter is what stays). Pruned as storages die.
_RECORDS: dict[StorageWeakRef, ParameterRecord] = {}


def _prune_records() -> None:
    for key in [key for key in _RECORDS if key.expired()]:
        del _RECORDS[key]


def _geometry(tensor: Tensor) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    return tuple(tensor.size()), tuple(tensor.stride()), tensor.storage_offset()


def _as_deferred_read(value: object) -> object:
    """A write's input: (a view of) a deferred parameter becomes a `_DeferredRead` of its value so far (the
    parameter then replays on a copy: it is read again later); anything else stays as it is."""
    if not isinstance(value, Tensor) or not value.is_meta:
        return value
    record = _RECORDS.get(_storage_key(value))
    if record is None:
        return value
    record.copied = True
    return _DeferredRead(record, len(record.writes), _geometry(value))


# In-place ops whose result does not read the values they overwrite.
_OVERWRITING_OPS = {
    torch.ops.aten.copy_.default,
    torch.ops.aten.fill_.Scalar,
    torch.ops.aten.fill_.Tensor,
    torch.ops.aten.zero_.default,
    torch.ops.aten.normal_.default,
    torch.ops.aten.uniform_.default,
}


def _overwrites_whole(func: torch._ops.OpOverload, write: _Write, record: ParameterRecord) -> bool:
    """Whether `write` replaces every value of the parameter whatever it was (then the tensor it was created
    as can go: a `torch.empty` is untouched memory only until the allocator hands out pages that a freed
    tensor touched, and a build that keeps every one holds up to a whole model; measured in docs/scale.md).
    Never for a record another one reads at an earlier write (`copied`): its writes are counted."""
    created = record.created
    return (
        func in _OVERWRITING_OPS
        and not record.copied
        and isinstance(created, Tensor)  # (meta already after an earlier overwrite: its writes go too)
        and created.is_contiguous()
        and write.geometry == _geometry(created)
    )


class _WriteRecorder(TorchDispatchMode):
    """Records the writes to deferred parameters (module docstring); every other op runs as it is."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch's protocol)
        kwargs = kwargs or {}
        if func is torch.ops.aten.clone.default and args[0].is_meta and _storage_key(args[0]) in _RECORDS:
            # copy.deepcopy of a module (nn.TransformerEncoder clones its layer): the copy's value is the
            # source's value so far.
            source = _RECORDS[_storage_key(args[0])]
            source.copied = True
            out = func(*args, **kwargs)
            _RECORDS[_storage_key(out)] = ParameterRecord((source, len(source.writes)))
            return out
        written = self._written_record(func, args)
        if written is None:  # reads of a deferred parameter give meta results, which fail where used
            return func(*args, **kwargs)
        target, record = written
        inputs = tree_map(_as_deferred_read, (args[1:], kwargs))
        for value in tree_flatten(inputs)[0]:
            if isinstance(value, Tensor) and value.is_meta:
                raise NotImplementedError(
                    f"deferred init cannot replay {func} into a parameter of shape {tuple(target.shape)}: it "
                    "reads a tensor computed on the meta device (build this module outside zoo.meta_init."
                    "deferred_init, or initialise it with ops on the parameter itself)"
                )
        write = _Write(func, _geometry(target), *inputs)
        if torch.Tag.nondeterministic_seeded in func.tags:
            generator = kwargs.get("generator") or torch.default_generator
            write.rng_state = generator.get_state()
            # Advance the stream as the real op would: the next parameter draws what it draws in a real build.
            scratch = torch.empty_strided(target.size(), target.stride(), dtype=target.dtype)
            func(scratch, *args[1:], **{**kwargs, "generator": generator})
        write.args = tree_map(lambda v: v.detach() if isinstance(v, Tensor) else v, write.args)
        if _overwrites_whole(func, write, record):
            # What came before no longer matters: forget it, and free the tensor the parameter was created as.
            record.created, record.writes = record.created.to("meta"), []
        record.writes.append(write)
        return func(*args, **kwargs)

    def _written_record(self, func, args: tuple) -> tuple[Tensor, ParameterRecord] | None:  # noqa: ANN001
        """The first argument, when the op writes it in place and it is (a view of) a deferred parameter."""
        schema = func._schema.arguments
        if not args or not isinstance(args[0], Tensor) or not args[0].is_meta:
            return None
        alias = schema[0].alias_info if schema else None
        if alias is None or not alias.is_write:
            return None
        record = _RECORDS.get(_storage_key(args[0]))
        return None if record is None else (args[0], record)


_DEFERRING = [False]  # inside a deferred_init block (a nested block adds nothing: one recorder at a time)


@contextmanager
def deferred_init() -> Iterator[None]:
    """Build modules inside this block with their parameters on `meta`, recording how a real build would have
    initialised them; `materialize` (after sharding) gives every rank those exact weights. Buffers are built
    for real. Every module whose parameters are registered inside the block is deferred (build datamodules
    and other helpers outside it). Re-entrant: a block inside a block is the outer one."""
    if _DEFERRING[0]:
        yield
        return
    recorder = _WriteRecorder()
    original = nn.Module.register_parameter

    def register_deferred(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is None or param.is_meta:  # already deferred (a tied weight registered twice) or meta
            return
        deferred = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
        # Attributes a library set on the parameter travel with it: transformers marks each loaded weight
        # `_is_hf_initialized` and re-initialises every parameter without the mark (random values over
        # the loaded Whisper weights, were the mark lost here).
        deferred.__dict__.update(param.__dict__)
        _RECORDS[_storage_key(deferred)] = ParameterRecord(param.detach())
        module._parameters[name] = deferred

    _prune_records()
    nn.Module.register_parameter = register_deferred  # type: ignore[method-assign]
    _DEFERRING[0] = True
    try:
        with recorder, warnings.catch_warnings():
            # Loading weights into a meta parameter is recorded (a copy_ replayed later), not lost.
            warnings.filterwarnings("ignore", message=r"for .*: copying from a non-meta parameter")
            yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]
        _DEFERRING[0] = False


def is_deferred(model: nn.Module) -> bool:
    """Whether any parameter of `model` was built by `deferred_init` and is not materialised yet."""
    return any(p.is_meta and _storage_key(p) in _RECORDS for p in model.parameters())


def value_of(tensor: Tensor) -> Tensor:
    """The real value of (a view of) a deferred parameter, replayed now on the CPU (its record stays, for
    `materialize`); any other tensor as it is. For reading a deferred model's weights to compute with them."""
    read = _as_deferred_read(tensor)
    return read.resolve() if isinstance(read, _DeferredRead) else tensor


def deferred_plan(model: nn.Module) -> dict[str, ParameterRecord]:
    """Every parameter name of `model` (tied names included) -> its record; read before FP8, activation
    checkpointing and FSDP2 replace the Parameter objects (they keep the names, AC adds a prefix)."""
    plan = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        record = _RECORDS.get(_storage_key(param)) if param.is_meta else None
        if record is None:
            if param.is_meta:
                raise ValueError(
                    f"parameter {name!r} is on the meta device but was not built under zoo.meta_init."
                    "deferred_init: nothing says how to initialise it"
                )
            continue
        plan[name] = record
    return plan


def materialize(
    model: nn.Module, plan: dict[str, ParameterRecord], device: torch.device | str = "cpu"
) -> None:
    """Give every parameter in `plan` its real value on `device`: the whole of it, or this rank's shard of it
    under FSDP2 (a DTensor). Replays one parameter at a time on the CPU (the random stream of a real build),
    so memory peaks at the shards plus one full parameter. Buffers keep their values."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    buffers = {name: buffer for name, buffer in model.named_buffers()}
    first_name: dict[int, str] = {}
    tied = []  # (alias, name): a parameter reachable under two names (tied embeddings)
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first_name:
            tied.append((name, first_name[id(param)]))
        first_name.setdefault(id(param), name)
    model.to_empty(device=device)  # the root's to_empty: FSDP2 re-points its shards at the new storage
    for alias, name in tied:  # to_empty gives each name its own tensor: tie them again
        owner, _, attribute = alias.rpartition(".")
        setattr(model.get_submodule(owner), attribute, model.get_parameter(name))
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])
        for name, param in model.named_parameters():
            record = plan.get(name) or plan.get(name.replace(_CHECKPOINT_PREFIX, ""))
            if record is None:
                raise ValueError(f"parameter {name!r} has no deferred-init record in the plan of this model")
            full = record.replay().to(param.device)
            if isinstance(param, DTensor):
                # src_data_rank=None: every rank replayed the same full value, so no rank sends anything.
                shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(shard.to_local())
            else:
                param.copy_(full)
            if not record.copied:  # the full value is not needed again: one full parameter at a time
                record.created, record.writes = full.new_empty(0), []
            del full
    _prune_records()  # the meta storages are gone: so are their records and the tensors they kept


__all__ = ["ParameterRecord", "deferred_init", "deferred_plan", "is_deferred", "materialize", "value_of"]
