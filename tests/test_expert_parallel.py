"""zoo.expert_parallel as a specification: an MoE layer whose routed experts are split over two gloo ranks
(EP=2, all-to-all dispatch and combine) gives each rank's tokens the outputs, and every weight the gradients,
of the single-process layer run on all tokens at once: the input gradient of each rank's rows, the router
gradient summed over ranks, each expert's weight gradients on the rank holding it (the matching slice of the
full gradient). Uneven token counts per rank and per expert, top-k 2 and 3, elastic width and top-k, router
replay, shared experts and the aux-free bias update (global loads) are covered; the reorder of received rows
is checked on its own. Over four ranks (EP=2 inside FSDP2 over 4, so each expert slice is FSDP-sharded over
2 ranks again) a model built on the meta device materialises the single-process weights and one step's
clipped gradients equal the single process's.

The distributed runs execute this file as a script (`python tests/test_expert_parallel.py MODE RANK WORLD
OUT_DIR PORT`), one process per rank, as torchrun would start them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ports import free_port
from safetensors.torch import load_file, save_file

from zoo.expert_parallel import expert_major_order, inverse_permutation
from zoo.models.moe import MoEFeedForward, expert_mask_of
from zoo.registry import create_model

REPO = Path(__file__).resolve().parent.parent
DIM, HIDDEN, N_EXPERTS = 16, 8, 4
TOKENS_PER_RANK = (13, 7)  # uneven on purpose: the all-to-all splits differ in both directions

# name -> (layer arguments, call arguments). Every case is run by both ranks and by the single process.
CASES: dict[str, tuple[dict, dict]] = {
    "top2": (dict(top_k=2), {}),
    "top3_shared_sigmoid": (dict(top_k=3, n_shared_experts=1, score_func="sigmoid", route_scale=2.5), {}),
    # Elastic width (expert 1 dropped for the step) and elastic top-k (1 instead of the layer's 2).
    "elastic": (dict(top_k=2), dict(top_k=1, expert_mask=[0, 2, 3])),
    # Router replay: forced expert sets, rank 0's tokens never reach expert 3, rank 1's never expert 0.
    "replay": (dict(top_k=2), dict(forced=True)),
    "aux_free": (dict(top_k=2, score_func="sigmoid", balancing="aux_free"), {}),
}


def make_layer(layer_args: dict) -> MoEFeedForward:
    torch.manual_seed(0)
    return MoEFeedForward(DIM, N_EXPERTS, HIDDEN, **layer_args)


def make_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All tokens, the probe their output is dotted with (the loss), and replay's forced expert sets."""
    g = torch.Generator().manual_seed(1)
    n = sum(TOKENS_PER_RANK)
    x, probe = torch.randn(n, DIM, generator=g), torch.randn(n, DIM, generator=g)
    first = TOKENS_PER_RANK[0]
    forced = torch.stack([torch.randperm(3, generator=g)[:2] for _ in range(n)])
    forced[first:] += 1  # rank 1's tokens choose among experts 1..3, rank 0's among 0..2
    return x, probe, forced


def rank_slice(rank: int) -> slice:
    start = sum(TOKENS_PER_RANK[:rank])
    return slice(start, start + TOKENS_PER_RANK[rank])


def run_case(
    layer: MoEFeedForward, call_args: dict, x: torch.Tensor, probe: torch.Tensor, forced: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Training-mode forward, the probe loss backward, then an aux-free bias step; returns out and x.grad."""
    x = x.clone().requires_grad_()
    kwargs: dict = {"top_k": call_args.get("top_k")}
    if "expert_mask" in call_args:
        kwargs["expert_mask"] = expert_mask_of(call_args["expert_mask"], N_EXPERTS)
    if call_args.get("forced"):
        kwargs["forced_indices"] = forced
    layer.train()
    out = layer(x, **kwargs).out
    (out * probe).sum().backward()
    layer.router.update_bias(0.1)
    return out.detach(), x.grad


def layer_rank(rank: int, out_dir: str) -> None:
    """One of two ranks: every case under EP=2 on this rank's tokens, the tensors to OUT_DIR/rank{r}..."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from zoo.expert_parallel import exchanged_bytes, shard_experts

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("expert_parallel",))
    x, probe, forced = make_inputs()
    part = rank_slice(rank)
    saved = {}
    for name, (layer_args, call_args) in CASES.items():
        layer = make_layer(layer_args)
        shard_experts(layer, mesh)
        out, x_grad = run_case(layer, call_args, x[part], probe[part], forced[part])
        gate_grad = layer.router.gate.weight.grad.clone()
        dist.all_reduce(gate_grad)  # the router is replicated: its gradient is the sum over ranks
        saved |= {f"{name}.out": out, f"{name}.x_grad": x_grad, f"{name}.gate_grad": gate_grad}
        saved[f"{name}.expert_bias"] = layer.router.expert_bias.clone()
        for w in ("w1", "w3", "w2"):
            saved[f"{name}.{w}_grad"] = getattr(layer.experts, w).grad.to_local().clone()
        saved[f"{name}.sent_bytes"] = torch.tensor(exchanged_bytes(layer))
    save_file(saved, str(Path(out_dir) / f"rank{rank}.safetensors"))


# A tiny unified model for the four-rank run: 4 experts, EP=2, FSDP2 over 4 ranks.
MODEL = dict(
    dim=32, n_layers=2, n_heads=2, n_kv_heads=1, n_experts=4, expert_hidden=16, top_k=2, max_seq_len=32
)
CLIP = 0.01  # far below the gradient norm: the clip scales every gradient, so a wrong total norm shows


def model_batch(model):  # noqa: ANN001, ANN201
    from zoo.datamodules.sequence import SequenceBuilder, TextSegment

    g = torch.Generator().manual_seed(2)
    docs = [[TextSegment((torch.randint(0, 16, (n,), generator=g) + model.vocab.text_offset).tolist())]
            for n in (9, 14, 5, 11)]
    return SequenceBuilder(model.vocab, 32).collate(docs)


def model_rank(rank: int, out_dir: str) -> None:
    """One of four ranks: deferred build, FSDP2 + EP=2, the full weights and one step's clipped gradients."""
    from torch.distributed.device_mesh import init_device_mesh

    from zoo.expert_parallel import clip_grad_norm_
    from zoo.meta_init import deferred_init
    from zoo.parallel import Parallelism, parallelize

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("data_parallel",))
    torch.manual_seed(0)
    with deferred_init():
        model = create_model("tiny", **MODEL)
    parallelize(model, Parallelism(fsdp=True, expert_parallel=2), mesh)
    weights = {f"weight.{n}": p.full_tensor() for n, p in model.named_parameters()}
    model(model_batch(model)).loss.backward()
    norm = clip_grad_norm_(list(model.parameters()), CLIP)
    grads = {f"grad.{n}": p.grad.full_tensor() for n, p in model.named_parameters()}
    local = model.backbone.layers[1].ffn.experts.w1.to_local().shape[0]
    if rank == 0:
        tensors = {**weights, **grads, "norm": norm, "local_rows": torch.tensor(local)}
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(Path(out_dir) / "model.safetensors"))


def rank_main(mode: str, rank: int, world: int, out_dir: str, port: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        (layer_rank if mode == "layer" else model_rank)(rank, out_dir)
    finally:
        dist.destroy_process_group()


def launch(mode: str, world: int, out_dir: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, mode, str(rank), str(world), str(out_dir), str(port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    try:
        outputs = [proc.communicate(timeout=600)[0] for proc in procs]
    finally:
        for proc in procs:  # a rank that failed leaves the others waiting in a collective
            proc.kill()
    assert [proc.returncode for proc in procs] == [0] * world, "\n".join(out[-3000:] for out in outputs)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, torch.Tensor]]:
    out_dir = tmp_path_factory.mktemp("ep")
    launch("layer", 2, out_dir)
    return [load_file(str(out_dir / f"rank{rank}.safetensors")) for rank in range(2)]


@pytest.mark.parametrize("name", list(CASES))
def test_ep2_outputs_and_gradients_equal_the_single_process_layer(ranks, name):
    layer_args, call_args = CASES[name]
    layer = make_layer(layer_args)
    x, probe, forced = make_inputs()
    out, x_grad = run_case(layer, call_args, x, probe, forced)
    local = N_EXPERTS // 2
    for rank, saved in enumerate(ranks):
        part = rank_slice(rank)
        torch.testing.assert_close(saved[f"{name}.out"], out[part], msg=f"rank {rank} outputs")
        torch.testing.assert_close(saved[f"{name}.x_grad"], x_grad[part], msg=f"rank {rank} input grads")
        torch.testing.assert_close(saved[f"{name}.gate_grad"], layer.router.gate.weight.grad)
        for w in ("w1", "w3", "w2"):
            full = getattr(layer.experts, w).grad
            expected = full[rank * local : (rank + 1) * local]
            torch.testing.assert_close(saved[f"{name}.{w}_grad"], expected, msg=f"rank {rank} {w} grads")
        # The aux-free step saw the global loads: both ranks hold the single process's bias.
        torch.testing.assert_close(saved[f"{name}.expert_bias"], layer.router.expert_bias)
        assert int(saved[f"{name}.sent_bytes"]) > 0, "no row crossed to the other rank: nothing was tested"
    if name == "aux_free":
        assert layer.router.expert_bias.abs().sum() > 0, "the bias did not move: the comparison proves little"


def test_received_rows_are_reordered_expert_major_and_back():
    # Rank 0 sent 1 row for local expert 0 and 2 for expert 1; rank 1 sent 3 and none.
    counts = torch.tensor([[1, 2], [3, 0]])
    received = torch.tensor([0, 10, 11, 100, 101, 102])  # r0e0 | r0e1 r0e1 | r1e0 r1e0 r1e0
    order = expert_major_order(counts)
    assert received[order].tolist() == [0, 100, 101, 102, 10, 11]
    assert received[order][inverse_permutation(order)].tolist() == received.tolist()


@pytest.mark.slow  # four processes on two cores: 40 s on a quiet machine, minutes on a loaded one
def test_fsdp2_plus_ep_over_four_ranks_gives_the_single_process_weights_and_clipped_gradients(tmp_path):
    launch("model", 4, tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert int(saved["local_rows"]) == 1, "4 experts, EP=2, then FSDP over 2: one expert row per rank"
    torch.manual_seed(0)
    model = create_model("tiny", **MODEL)
    for name, p in model.named_parameters():
        assert torch.equal(saved[f"weight.{name}"], p.detach()), name
    model(model_batch(model)).loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    torch.testing.assert_close(saved["norm"], norm)
    assert norm > 10 * CLIP, "the clip must bite, or a wrong total norm would not show"
    for name, p in model.named_parameters():
        torch.testing.assert_close(saved[f"grad.{name}"], p.grad, msg=name)


if __name__ == "__main__":
    rank_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
