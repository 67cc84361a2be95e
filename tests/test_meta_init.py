"""zoo.meta_init as a specification: a model built under `deferred_init` holds no parameter memory, and once
materialised (alone, or sharded by FSDP2 over two gloo processes) it has exactly the weights a plain build
with the same seed has, frozen tokenizer weights loaded from a file included; the random stream after the
build is where a plain build leaves it; what cannot be replayed is refused by name.

The two-process run executes this file as a script (`python tests/test_meta_init.py RANK OUT_DIR PORT`), one
process per rank, as torchrun would start them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ports import free_port
from safetensors.torch import load_file, save_file
from torch import nn

from zoo.meta_init import deferred_init, deferred_plan, is_deferred, materialize
from zoo.models.backbone import UnifiedTransformer
from zoo.models.unified import UnifiedModel
from zoo.parallel import Parallelism, parallelize
from zoo.registry import create_model
from zoo.tokenizers.audio import AudioCodec
from zoo.tokenizers.visual import VisualTokenizer
from zoo.tokenizers.vocab import UnifiedVocab
from zoo.weights import save_weights_file

REPO = Path(__file__).resolve().parent.parent
TINY = dict(
    dim=32, n_layers=2, n_heads=2, n_kv_heads=1, n_experts=4, expert_hidden=16, top_k=2, max_seq_len=64
)


def media_model(tokenizer_weights: str | None) -> UnifiedModel:
    """A unified model with every optional part: a frozen visual tokenizer (from a file when given), an audio
    codec (whose depth transformer deep-copies its layers), MTP."""
    torch.manual_seed(0)
    tokenizer = VisualTokenizer(weights=tokenizer_weights)
    vocab = UnifiedVocab(text_size=64, visual_size=tokenizer.codebook_size, audio_size=256, audio_levels=4)
    backbone = UnifiedTransformer(**TINY)
    return UnifiedModel(backbone, vocab, mtp_depth=1, visual_tokenizer=tokenizer, audio_codec=AudioCodec())


def assert_same_weights(expected: nn.Module, actual: nn.Module) -> None:
    want, got = expected.state_dict(), actual.state_dict()
    assert list(want) == list(got)
    different = [name for name in want if not torch.equal(want[name], got[name])]
    assert different == [], f"{len(different)} of {len(want)} tensors differ, e.g. {different[:5]}"


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 'trained' visual tokenizer on disk: weights no seeded build would draw."""
    torch.manual_seed(99)
    tokenizer = VisualTokenizer()
    for p in tokenizer.parameters():
        p.data.uniform_(-1, 1)
    return str(save_weights_file(tokenizer, tmp_path_factory.mktemp("tokenizer") / "model.safetensors"))


def test_a_deferred_build_holds_its_parameters_on_meta_and_its_buffers_for_real():
    with deferred_init():
        model = create_model("tiny", **TINY)
    assert is_deferred(model)
    assert all(p.is_meta for p in model.parameters())
    # Nor does it keep the tensors the parameters were created as (`torch.empty`: allocated memory, resident
    # once the allocator reuses pages a freed tensor touched) where an init overwrote them whole: what stays
    # real is the few created with values (norm weights, `torch.ones`), not a model's worth.
    records = {id(r): r for r in deferred_plan(model).values()}.values()
    real = [r.created for r in records if isinstance(r.created, torch.Tensor) and not r.created.is_meta]
    kept = sum(t.nbytes for t in real)
    total = sum(p.nbytes for p in model.parameters())
    assert kept < 0.02 * total, f"the records keep {kept} of the parameters' {total} bytes"
    # Buffers are built for real: the rotary table is the plain build's.
    torch.manual_seed(0)
    plain = create_model("tiny", **TINY)
    assert torch.equal(model.backbone.rope.inv_freq, plain.backbone.rope.inv_freq)


def test_a_materialised_deferred_build_has_the_plain_builds_weights_and_leaves_the_same_random_stream(
    tokenizer_file,
):
    plain = media_model(tokenizer_file)
    after_plain = torch.rand(4)
    with deferred_init():
        deferred = media_model(tokenizer_file)
    after_deferred = torch.rand(4)
    assert torch.equal(after_plain, after_deferred), "the build must consume the random stream as a plain one"
    materialize(deferred, deferred_plan(deferred))
    assert not is_deferred(deferred)
    assert_same_weights(plain, deferred)
    # The frozen tokenizer holds the file's weights, not a fresh initialisation.
    from_file = load_file(tokenizer_file)
    assert all(torch.equal(t, deferred.visual_tokenizer.state_dict()[k]) for k, t in from_file.items())


def test_tied_embeddings_stay_one_tensor_after_materialisation():
    torch.manual_seed(0)
    plain = create_model("tiny", **TINY, tie_embeddings=True)
    torch.manual_seed(0)
    with deferred_init():
        deferred = create_model("tiny", **TINY, tie_embeddings=True)
    materialize(deferred, deferred_plan(deferred))
    assert deferred.text_head.output.weight is deferred.text_embed.weight
    assert_same_weights(plain, deferred)


def test_parallelize_materialises_a_deferred_model_without_fsdp():
    torch.manual_seed(0)
    plain = create_model("tiny", **TINY)
    torch.manual_seed(0)
    with deferred_init():
        deferred = create_model("tiny", **TINY)
    parallelize(deferred, Parallelism(activation_checkpointing=True))
    assert not any(p.is_meta for p in deferred.parameters())
    plain_weights = {name: p for name, p in plain.named_parameters()}
    for name, p in deferred.named_parameters():  # checkpoint wrappers add a prefix to the names
        assert torch.equal(p, plain_weights[name.replace("_checkpoint_wrapped_module.", "")]), name


def test_a_parameters_own_attributes_survive_its_deferral():
    """Libraries mark parameters (transformers: `_is_hf_initialized` on each loaded weight, and re-initialises
    the unmarked); the deferred parameter must carry the mark, and the marked value must replay."""

    class Marked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            weight = nn.Parameter(torch.full((3,), 7.0))
            weight._loaded_from_file = True
            self.weight = weight
            if not getattr(self.weight, "_loaded_from_file", False):  # as transformers treats unmarked ones
                nn.init.normal_(self.weight)

    with deferred_init():
        module = Marked()
    assert module.weight.is_meta and module.weight._loaded_from_file
    materialize(module, deferred_plan(module))
    assert torch.equal(module.weight, torch.full((3,), 7.0))


def test_a_task_built_in_python_holds_its_model_once_not_again_in_its_initial_hyper_parameters():
    """Lightning deep-copies what `save_hyperparameters` stores; storing the live model copied it whole (and,
    under deferred init, marked every record copied, so none was freed after its replay)."""
    from zoo.tasks.pretrain import UnifiedPretraining

    def leaves(value: object) -> list[object]:
        if isinstance(value, dict):
            return [leaf for item in value.values() for leaf in leaves(item)]
        if isinstance(value, (list, tuple)):
            return [leaf for item in value for leaf in leaves(item)]
        return [value]

    with deferred_init():
        task = UnifiedPretraining(create_model("tiny", **TINY))
    initial = leaves(dict(task._hparams_initial))
    assert not any(isinstance(leaf, (nn.Module, torch.Tensor)) for leaf in initial)
    assert task.hparams_initial == task.hparams
    assert not any(record.copied for record in deferred_plan(task).values())


def test_a_copy_from_another_deferred_parameter_replays_its_value_at_that_point():
    """Loading one deferred model into another (init_from under meta init) is recorded, not refused: the copy
    reads the source's value as it was then (a view of it included), not what the source became later."""
    torch.manual_seed(0)
    plain_source, plain_target = nn.Linear(4, 6), nn.Linear(4, 6)
    with torch.no_grad():
        plain_target.weight.copy_(plain_source.weight)
        plain_target.bias[:3].copy_(plain_source.bias[3:])
        plain_source.weight.zero_()  # written after the copy: the target must not see it
    torch.manual_seed(0)
    with deferred_init():
        source, target = nn.Linear(4, 6), nn.Linear(4, 6)
        with torch.no_grad():
            target.weight.copy_(source.weight)
            target.bias[:3].copy_(source.bias[3:])
            source.weight.zero_()
    model = nn.ModuleDict({"source": source, "target": target})
    materialize(model, deferred_plan(model))
    assert_same_weights(nn.ModuleDict({"source": plain_source, "target": plain_target}), model)


def test_a_write_that_cannot_be_replayed_is_refused_naming_the_op():
    class FromMeta(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(4, 4))
            basis = torch.empty(4, 4, device="meta").normal_()  # computed on meta: nothing to replay
            self.weight.data.copy_(basis)

    with pytest.raises(NotImplementedError, match=r"aten\.copy_.*shape \(4, 4\).*meta device"):
        with deferred_init():
            FromMeta()


def test_a_meta_parameter_built_outside_deferred_init_is_named():
    model = create_model("tiny", device="meta", **TINY)
    with pytest.raises(ValueError, match=r"parameter 'backbone\..*' is on the meta device but was not built"):
        deferred_plan(model)


def test_zoo_fit_builds_the_model_on_meta_when_the_config_shards_it(tmp_path, monkeypatch):
    from zoo.cli.lightning_cli import ZooCLI

    monkeypatch.chdir(tmp_path)
    quickstart = ["--config", str(REPO / "configs/quickstart.yaml"), f"--trainer.default_root_dir={tmp_path}"]
    sharded = ZooCLI(args=[*quickstart, "--config", str(REPO / "configs/strategy/fsdp.yaml")], run=False)
    assert is_deferred(sharded.model.model) and all(p.is_meta for p in sharded.model.model.parameters())
    single = ZooCLI(args=quickstart, run=False)
    assert not any(p.is_meta for p in single.model.model.parameters())


# --- two processes: FSDP2 shards a deferred model, each rank materialises its shards ----------------------


def rank_main(rank: int, out_dir: str, port: int) -> None:
    """One rank: deferred build, FSDP2 over a two-process gloo mesh, materialise; the full state dict gathered
    from the shards goes to OUT_DIR (rank 0), with the peak of parameter bytes this rank held."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",))
        with deferred_init():
            model = media_model(str(Path(out_dir) / "tokenizer.safetensors"))
        parallelize(model, Parallelism(fsdp=True), mesh)
        local = sum(p.to_local().numel() for p in model.parameters())
        state = model.state_dict()
        full = {name: t.full_tensor() if hasattr(t, "full_tensor") else t for name, t in state.items()}
        if rank == 0:
            gathered = {k: v.contiguous() for k, v in full.items()}
            save_file(gathered, str(Path(out_dir) / "gathered.safetensors"))
            total = sum(p.numel() for p in model.parameters())
            (Path(out_dir) / "shards.json").write_text(json.dumps({"local_fraction": local / total}))
    finally:
        dist.destroy_process_group()


def test_fsdp2_ranks_materialise_the_single_process_weights_from_a_deferred_build(tokenizer_file, tmp_path):
    Path(tmp_path / "tokenizer.safetensors").write_bytes(Path(tokenizer_file).read_bytes())
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    port = free_port()
    ranks = [
        subprocess.Popen(
            [sys.executable, __file__, str(rank), str(tmp_path), str(port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [proc.communicate(timeout=180)[0] for proc in ranks]
    assert [proc.returncode for proc in ranks] == [0, 0], "\n".join(out[-3000:] for out in outputs)
    gathered = load_file(str(tmp_path / "gathered.safetensors"))
    plain = media_model(tokenizer_file).state_dict()
    assert sorted(gathered) == sorted(plain)
    different = [name for name in plain if not torch.equal(plain[name], gathered[name])]
    assert different == [], f"{len(different)} tensors differ from the single-process build: {different[:5]}"
    # Each rank really holds only its half (the frozen tokenizer and codec are sharded too).
    assert 0.45 < json.loads((tmp_path / "shards.json").read_text())["local_fraction"] < 0.55


if __name__ == "__main__":
    rank_main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
