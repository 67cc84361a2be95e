"""Exporting a distributed checkpoint as a specification (issue 17, "large checkpoints"): `zoo export` of an
FSDP2 (DCP) folder reads the weights straight into the rebuilt model, so the process never holds two full
copies of them, and the optimizer states in the folder are never read; what it writes is the trained model.

The checkpoint is written the way Lightning's `ModelParallelStrategy.save_checkpoint` writes one (DCP of
`{"state_dict", "optimizer_0"}` with AdamW's two moments per parameter, `meta.pt` beside it) from a model of
48 MB. The export runs in a fresh process (`python tests/test_export_memory.py MODE CKPT OUT`), which reports
its resident set before a second export (the first paid for imports and lazy initialisation) and its peak
during it (`VmHWM`, reset before it): the difference, in copies of the weights. The same measure on torch's
`dcp_to_torch_save` consolidation, which the export used before, shows that it can fail (a slow test): that
path holds the weights and both moments at once, then the model on top.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
# Wide enough that the weights (48 MB) dwarf the noise of the allocator and of DCP's per-file buffers.
MODEL = dict(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, n_experts=16, expert_hidden=256, top_k=2,
             max_seq_len=64)  # fmt: skip
# Measured: 1.17x the weights for the export (one copy, the model, and DCP reading a tensor at a time: 2x
# the largest, 4 MB); 3.0x for the consolidation. A second copy anywhere passes 2x.
MAX_COPIES = 1.3


def build_model():
    import zoo

    torch.manual_seed(0)
    return zoo.create_model("tiny", **MODEL)


def write_distributed_checkpoint(model: torch.nn.Module, folder: Path) -> None:
    """A Lightning-style DCP folder of a `UnifiedPretraining` task: its state dict (the model under `model.`),
    AdamW's moments by parameter name, and `meta.pt` with the hyper-parameters as the task records them
    (`to_config`; tests/test_parallel.py exports a folder Lightning itself wrote)."""
    import torch.distributed.checkpoint as dcp

    from zoo.config import to_config

    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    step = torch.tensor(7.0)
    moments = {
        f"model.{name}": {"exp_avg": torch.randn_like(p), "exp_avg_sq": torch.rand_like(p), "step": step}
        for name, p in model.named_parameters()
    }
    groups = [{"lr": 1e-3, "weight_decay": 0.1, "params": sorted(moments)}]
    optimizer = {"state": moments, "param_groups": groups}
    dcp.save({"state_dict": state, "optimizer_0": optimizer}, checkpoint_id=folder)
    hyper_parameters = {"model": to_config(model), "lr": 1e-3, "warmup_steps": 100}
    torch.save({"hyper_parameters": hyper_parameters, "global_step": 7, "epoch": 0}, folder / "meta.pt")


def weight_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def measure(mode: str, checkpoint: Path, out: Path) -> dict[str, int]:
    # A fixed mmap threshold makes glibc return every freed tensor to the system at once (the default raises
    # it as tensors are freed, keeping them in the heap), so the resident set follows the live tensors.
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    command = [sys.executable, __file__, mode, str(checkpoint), str(out)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def exported_copies(tmp_path: Path, mode: str) -> tuple[float, object]:
    """The peak memory of `mode` on a fresh 48 MB checkpoint, in copies of its weights; and the model."""
    model = build_model()
    write_distributed_checkpoint(model, tmp_path / "last.ckpt")
    figures = measure(mode, tmp_path / "last.ckpt", tmp_path / "exported")
    copies = (figures["peak"] - figures["before"]) / weight_bytes(model)
    print(f"{mode}: {copies:.2f}x the weights ({weight_bytes(model) / 2**20:.1f} MiB)")
    return copies, model


@pytest.mark.slow  # ~10 s: a fresh process importing torch and the zoo; make test is near its 15 minutes
def test_zoo_export_of_a_distributed_checkpoint_holds_one_copy_of_the_weights_and_writes_the_trained_model(
    tmp_path,
):
    from safetensors.torch import load_file

    from zoo.hub import from_pretrained

    copies, model = exported_copies(tmp_path, "export")
    assert copies < MAX_COPIES, f"the export held {copies:.2f}x the weights (one copy is 1.0x)"
    exported = from_pretrained(tmp_path / "exported")
    for name, value in model.state_dict().items():
        assert torch.equal(exported.state_dict()[name], value), name
    assert not any("exp_avg" in k for k in load_file(tmp_path / "exported" / "model.safetensors"))


@pytest.mark.slow
def test_the_memory_measure_sees_the_copies_of_a_consolidating_export(tmp_path):
    """The same measure fails the consolidation the export did before (all tensors, then the model)."""
    copies, _ = exported_copies(tmp_path, "consolidate")
    assert copies > 2.5, "the measure must see the consolidation's copies, or the export's figure is moot"


def test_a_distributed_checkpoint_that_does_not_fit_its_hyper_parameters_is_refused_naming_it(tmp_path):
    from zoo.hub import load_lightning_checkpoint

    write_distributed_checkpoint(build_model(), tmp_path / "last.ckpt")
    meta = torch.load(tmp_path / "last.ckpt" / "meta.pt", weights_only=True)
    meta["hyper_parameters"]["model"]["init_args"]["backbone"]["init_args"]["n_experts"] = 8
    torch.save(meta, tmp_path / "last.ckpt" / "meta.pt")
    try:
        load_lightning_checkpoint(tmp_path / "last.ckpt")
    except ValueError as err:
        assert "last.ckpt" in str(err) and "size mismatch" in str(err) and "experts" in str(err), err
    else:
        raise AssertionError("a checkpoint of 16 experts loaded into a model of 8")


def test_zoo_export_of_a_distributed_checkpoint_writes_shards_past_max_shard_size(tmp_path, capsys):
    from zoo.cli import main as cli_main
    from zoo.hub import from_pretrained

    model = build_model()
    write_distributed_checkpoint(model, tmp_path / "last.ckpt")
    out = tmp_path / "exported"
    checkpoint = str(tmp_path / "last.ckpt")
    cli_main(["export", "--checkpoint", checkpoint, "--out", str(out), "--max_shard_size", "20MB"])
    assert "wrote" in capsys.readouterr().out
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) == 3 and (out / "model.safetensors.index.json").is_file()  # 48 MB in 20 MB shards
    assert not (out / "model.safetensors").exists()
    exported = from_pretrained(out)
    for name, value in model.state_dict().items():
        assert torch.equal(exported.state_dict()[name], value), name


def _status_bytes(field: str) -> int:
    """`VmRSS` (resident now) or `VmHWM` (its peak) of this process, from /proc/self/status. Not `ru_maxrss`:
    Linux carries that over from the parent through fork and exec (the pytest process, far larger)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    """Start the peak (`VmHWM`) from the resident set now (Linux: 5 to clear_refs), so that it measures the
    export alone."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def _run(mode: str, checkpoint: str, out: str) -> None:
    """In the fresh process: one run of `mode` to pay what is paid once (imports, lazy initialisation, DCP's
    first plan), then the measured run: what it adds scales with the model."""
    torch.set_num_threads(1)
    from zoo.hub import load_lightning_checkpoint, read_lightning_checkpoint, save_pretrained

    def once() -> None:
        if mode == "export":  # what `zoo export` runs (without importing Lightning's CLI: a faster test)
            model, tokenizer = load_lightning_checkpoint(checkpoint)
            save_pretrained(model, out, tokenizer)
        else:  # what the export did before: consolidate every tensor, then build the model and load it
            state = read_lightning_checkpoint(checkpoint)["state_dict"]
            model = build_model()
            model.load_state_dict({k[len("model."):]: v for k, v in state.items() if k.startswith("model.")})

    once()
    gc.collect()
    _reset_peak()
    before = _status_bytes("VmRSS")
    once()
    print(json.dumps({"before": before, "peak": _status_bytes("VmHWM")}))


if __name__ == "__main__":
    _run(*sys.argv[1:4])
