"""`zoo plan` as a specification: the `base` preset (and the base config overlay) sharded over a fake mesh of
64 ranks, on the meta device, without GPUs: each rank holds 1/64 of the parameters, their gradients and two
AdamW states, and the largest unit FSDP2 gathers is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zoo.cli.plan import ADAMW_STATES, plan_main, plan_model
from zoo.models.moe import Experts
from zoo.parallel import Parallelism
from zoo.registry import create_model

REPO = Path(__file__).resolve().parent.parent
WORLD = 64


def test_base_over_64_ranks_holds_one_64th_of_its_parameters_and_their_optimizer_state_per_rank():
    model = create_model("base", device="meta")
    total = model.num_parameters()
    plan = plan_model(model, Parallelism(fsdp=True), WORLD)
    assert plan.mesh == {"data_parallel": WORLD}
    assert plan.params_total == total
    # Dim-0 shards round up: a rank holds at most one row more of each tensor than an exact 1/64.
    assert total / WORLD <= plan.params_per_rank <= total / WORLD * 1.02
    assert plan.param_bytes_per_rank == 4 * plan.params_per_rank  # fp32 master weights
    assert plan.optimizer_bytes_per_rank == ADAMW_STATES * plan.grad_bytes_per_rank
    expected = plan.param_bytes_per_rank + plan.grad_bytes_per_rank + plan.optimizer_bytes_per_rank
    assert plan.state_bytes_per_rank == expected
    # An MoE block (64 experts) outweighs the dense blocks and the root (embeddings, heads); it is gathered
    # whole: its full fp32 bytes, not a shard.
    moe_block = create_model("base", device="meta").backbone.layers[2]
    assert plan.largest_gathered_unit == "backbone.layers.2"
    assert plan.largest_gathered_unit_bytes == 4 * sum(p.numel() for p in moe_block.parameters())


def test_zoo_plan_reads_the_config_a_run_would_train_and_prints_one_json_line(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    configs = [str(REPO / "configs/quickstart.yaml"), str(REPO / "configs/presets/base.yaml")]
    plan_main([flag for path in configs for flag in ("--config", path)] + ["--world_size", str(WORLD)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert "per rank: parameters" in "\n".join(lines)
    printed = json.loads(lines[-1])
    assert printed["world_size"] == WORLD and printed["mesh"] == {"data_parallel": WORLD}
    assert printed["params_total"] == create_model("base", device="meta").num_parameters()


def test_zoo_plan_refuses_a_model_that_is_not_on_the_meta_device():
    with pytest.raises(ValueError, match="meta device"):
        plan_model(create_model("tiny"), Parallelism(fsdp=True), 2)


def test_expert_parallel_plan_splits_each_layers_experts_over_their_ranks_and_shrinks_the_gathered_unit():
    model = create_model("base", device="meta")
    n_experts = model.backbone.n_experts
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    expert_bytes = 4 * sum(p.numel() for m in experts for p in m.parameters())
    layer_experts = 4 * sum(p.numel() for p in model.backbone.layers[2].ffn.experts.parameters())
    plan = plan_model(model, Parallelism(fsdp=True, expert_parallel=8), WORLD)
    assert plan.mesh == {"data_parallel": WORLD, "expert_data_parallel": WORLD // 8, "expert_parallel": 8}
    assert plan.expert_parallel == 8 and plan.expert_bytes_total == expert_bytes
    # E/8 experts per rank, sharded again over the 8 ranks holding the same ones: 1/64 of the bytes.
    assert plan.expert_bytes_per_rank == expert_bytes // WORLD
    # The MoE block is no longer gathered whole: its experts are gathered apart, E/8 of them.
    assert plan.largest_gathered_unit != "backbone.layers.2"
    assert plan.largest_gathered_unit_bytes < layer_experts
    assert n_experts % 8 == 0


def test_expert_parallel_that_does_not_divide_the_ranks_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"expert_parallel=3 does not divide the 64 data-parallel ranks"):
        plan_model(create_model("base", device="meta"), Parallelism(fsdp=True, expert_parallel=3), WORLD)
    with pytest.raises(ValueError, match="needs fsdp=True"):
        Parallelism(expert_parallel=2)
