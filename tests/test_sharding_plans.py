"""Each stage's `ShardingPlan` (zoo/tasks/sharding.py) as a specification, in one process: on a fake mesh
of two ranks (torch's fake process group: collectives are no-ops, sharding is real) every trained parameter
of every stage is sharded and a plan that misses one is refused by name; FP8 converts exactly the linears
docs/scale.md lists per stage; a model built on `meta` materialises with the single-process weights.
The real two-process runs are tests/test_stage_sharding.py.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from zoo.parallel import Parallelism
from zoo.tasks.sharding import ShardingPlan, shard_stage

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
STAGES = {
    "visual_2d": "tokenizers/visual_2d.yaml",
    "visual_3d": "tokenizers/visual_3d.yaml",
    "audio": "tokenizers/audio.yaml",
    "vision": "vision/encoder_dual.yaml",
    "refiner": "refiner/shapes.yaml",
}


@pytest.fixture(autouse=True)
def clean_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.argv", ["zoo"])


@pytest.fixture
def fake_mesh() -> Iterator:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",))
    finally:
        dist.destroy_process_group()
        # vector-quantize-pytorch caches `is_distributed()` for the process (functools.cache): a codec built
        # under the fake group would make every later codec of this pytest process all-reduce.
        import vector_quantize_pytorch.residual_vq as residual_vq
        import vector_quantize_pytorch.vector_quantize_pytorch as vq

        for module in (vq, residual_vq):
            clear = getattr(getattr(module, "is_distributed", None), "cache_clear", None)
            if clear is not None:
                clear()


def build(stage: str, tmp_path: Path, *extra: str):  # noqa: ANN201 (the stage's LightningModule)
    from zoo.cli import ZooCLI

    args = ["--config", str(CONFIGS / STAGES[stage]), *extra, f"--trainer.default_root_dir={tmp_path}"]
    return ZooCLI(args=[*args, "--trainer.logger=false"], run=False).model


_BUILT: dict[str, nn.Module] = {}


def built(stage: str, tmp_path: Path):  # noqa: ANN201 (the stage's LightningModule)
    """A fresh copy of the stage's task, parsed and built once per session (the CLI is the slow part)."""
    if stage not in _BUILT:
        _BUILT[stage] = build(stage, tmp_path)
    return copy.deepcopy(_BUILT[stage])


@pytest.mark.parametrize("stage", STAGES)
def test_every_trained_parameter_of_a_stage_is_sharded_over_the_mesh(stage, tmp_path, fake_mesh):
    task = built(stage, tmp_path)
    trained = {n: p.numel() for n, p in task.named_parameters() if p.requires_grad}
    shard_stage(task, task.sharding_plan(), Parallelism(fsdp=True), fake_mesh)
    params = dict(task.named_parameters())
    assert all(isinstance(params[n], DTensor) for n in trained)
    local = sum(params[n].to_local().numel() for n in trained)
    assert 0.45 < local / sum(trained.values()) < 0.6, "each of two ranks holds about half"


def test_a_plan_that_misses_a_trained_module_is_refused_by_name(tmp_path, fake_mesh):
    task = built("refiner", tmp_path)
    plan = task.sharding_plan()
    missing = ShardingPlan(blocks=plan.blocks, groups=(), frozen=plan.frozen)  # the UNet's stem is left out
    with pytest.raises(ValueError, match=r"unsharded: \['refiner\.unet\.conv_in\.weight'"):
        shard_stage(task, missing, Parallelism(fsdp=True), fake_mesh)


def float8_linears(task: nn.Module) -> set[str]:
    from torchao.float8.float8_linear import Float8Linear

    return {name for name, m in task.named_modules() if isinstance(m, Float8Linear)}


@pytest.mark.parametrize("stage", ["visual_2d", "audio"])
def test_fp8_converts_nothing_in_the_conv_tokenizers(stage, tmp_path):
    task = built(stage, tmp_path)
    shard_stage(task, task.sharding_plan(), Parallelism(fp8=True))
    assert float8_linears(task) == set()


def test_fp8_takes_the_vision_encoders_blocks_merger_and_mlps_but_not_its_heads(tmp_path):
    task = built("vision", tmp_path)
    shard_stage(task, task.sharding_plan(), Parallelism(fp8=True))
    converted = float8_linears(task)
    assert {"encoder.vit_path.blocks.0.attn.qkv", "encoder.vit_path.blocks.3.mlp.fc2"} <= converted
    mlps = {"encoder.patch_merger.mlp.0", "cell_head.mlp.1", "caption_encoder.encoder.layers.0.linear1"}
    assert mlps <= converted
    heads = ("image_proj", "caption_encoder.out", "cell_head.outputs", "out_proj")
    assert not [name for name in converted if any(h in name for h in heads)]


def test_fp8_takes_the_refiners_timestep_and_attention_linears_never_a_conv(tmp_path):
    task = built("refiner", tmp_path)
    shard_stage(task, task.sharding_plan(), Parallelism(fp8=True))
    converted = float8_linears(task)
    assert "refiner.unet.time_embedding.linear_1" in converted
    assert any(name.endswith("attentions.0.to_q") for name in converted)
    assert any(name.endswith("time_emb_proj") for name in converted)
    assert not any(isinstance(task.get_submodule(name), nn.Conv2d) for name in converted)


@pytest.mark.parametrize("stage", ["visual_2d", "audio", "audio_whisper", "vision", "refiner"])
def test_a_stage_built_on_meta_materialises_the_single_process_weights(stage, tmp_path):
    from zoo.meta_init import deferred_init

    extra: tuple[str, ...] = ()
    if stage == "audio_whisper":  # the codec distilled toward a Whisper teacher loaded from a folder
        pytest.importorskip("transformers", reason="a Whisper teacher needs the `whisper` extra")
        from whisper_helpers import save_tiny_whisper

        folder = save_tiny_whisper(tmp_path / "whisper")
        extra = ("--config", str(CONFIGS / "tokenizers/audio_whisper.yaml"))
        extra += (f"--model.init_args.teacher.init_args.path={folder}",)
        stage = "audio"
    reference = build(stage, tmp_path, *extra)
    assert type(reference).meta_init_with_fsdp
    torch.manual_seed(0)
    with deferred_init():
        task = build(stage, tmp_path, *extra)  # the CLI seeds as the reference's build did
    assert all(p.is_meta for p in task.parameters())
    shard_stage(task, task.sharding_plan(), Parallelism())
    expected = reference.state_dict()
    for name, value in task.state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_sharding_a_stage_twice_changes_nothing(tmp_path, fake_mesh):
    """Lightning may call `configure_model` twice (fit, then test)."""
    task = built("vision", tmp_path)
    config = Parallelism(fsdp=True, activation_checkpointing=True)
    shard_stage(task, task.sharding_plan(), config, fake_mesh)
    before = [(name, type(m).__name__) for name, m in task.named_modules()]
    shard_stage(task, task.sharding_plan(), config, fake_mesh)
    assert [(name, type(m).__name__) for name, m in task.named_modules()] == before
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    assert all(isinstance(block, CheckpointWrapper) for block in task.encoder.vit_path.blocks)


def test_the_plain_component_of_a_sharded_module_is_rebuilt_as_its_own_class(tmp_path, fake_mesh):
    from torch.distributed.fsdp import fully_shard

    from zoo.tasks.sharding import plain_component

    task = built("visual_2d", tmp_path)
    expected = {k: v.clone() for k, v in task.tokenizer.state_dict().items()}
    fully_shard(task.tokenizer, mesh=fake_mesh)  # FSDP2 renames the class; the fake mesh gathers nothing,
    # so only the class and the keys are checked here (the values: tests/test_stage_sharding.py)
    plain = plain_component(task.tokenizer)
    assert type(plain).__name__ == "VisualTokenizer"
    assert plain.state_dict().keys() == expected.keys()
