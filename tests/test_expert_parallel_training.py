"""FSDP2 + expert parallelism end to end: a tiny UnifiedPretraining trained for a few steps on two gloo
processes with `Parallelism(fsdp=True, expert_parallel=2)` (each rank holding half of every MoE layer's
experts, tokens exchanged by all-to-all) gives the single-process losses, with the model built on the meta
device as `zoo fit` builds it, gradient clipping over the two meshes, and elastic width/top-k, activation
checkpointing and the aux-free bias update on.

As in tests/test_parallel.py every rank gets the same batches, so the reduced gradients equal the single
process's (tests/test_expert_parallel.py checks the layer with different tokens per rank); this file runs
itself as the distributed script (`python tests/test_expert_parallel_training.py OUT.json`: Lightning's
launcher re-runs it for rank 1).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_parallel import FSDP_RTOL, TINY, fit

from zoo.meta_init import deferred_init
from zoo.models.elastic import ElasticSampler
from zoo.parallel import FSDP2Strategy, Parallelism
from zoo.registry import create_model
from zoo.tasks.pretrain import UnifiedPretraining

REPO = Path(__file__).resolve().parent.parent
# aux-free balancing, so the bias update (loads all-reduced over the ranks) steers routing during the run.
EP_TINY = {**TINY, "balancing": "aux_free"}
VARIANTS = {
    "ep": Parallelism(fsdp=True, expert_parallel=2),
    "ep_checkpointed": Parallelism(fsdp=True, expert_parallel=2, activation_checkpointing=True),
}


def make_task(parallel: Parallelism = Parallelism(), deferred: bool = False) -> UnifiedPretraining:
    torch.manual_seed(0)
    if deferred:
        with deferred_init():
            model = create_model("tiny", **EP_TINY)
    else:
        model = create_model("tiny", **EP_TINY)
    # Elastic width and top-k on most steps (seeded per step: every rank draws the same sub-model).
    elastic = ElasticSampler(p_full_depth=1.0, p_full_width=0.3, p_full_topk=0.3, seed=3)
    return UnifiedPretraining(model, lr=3e-3, warmup_steps=2, parallel=parallel, elastic=elastic)


def main(out: str) -> None:
    """Runs in both ranks: each variant fits from a deferred build; rank 0 writes the losses."""
    torch.set_num_threads(1)
    results: dict[str, object] = {}
    for name, parallel in VARIANTS.items():
        task = make_task(parallel, deferred=True)
        results[name] = fit(task, 2, FSDP2Strategy())
        experts = task.model.backbone.layers[1].ffn.experts
        results[name + "_local_experts"] = experts.w1.to_local().shape[0]
        results[name + "_expert_bias"] = task.model.backbone.layers[1].ffn.router.expert_bias.tolist()
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        Path(out).write_text(json.dumps(results))


@pytest.fixture(scope="module")
def distributed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("ep_fit") / "losses.json"
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}", "OMP_NUM_THREADS": "1"}
    env.pop("MASTER_PORT", None)
    command = [sys.executable, __file__, str(out)]
    proc = subprocess.run(command, cwd=out.parent, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"distributed run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


@pytest.mark.slow  # about 80 s on two loaded cores: two distributed fits and two single ones
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fsdp2_plus_expert_parallelism_on_two_processes_gives_the_single_process_losses(distributed, variant):
    task = make_task()
    single = fit(task, 1, "auto")
    assert single[-1] < single[0] - 0.5, "the reference run should learn, or the comparison proves little"
    assert distributed[variant] == pytest.approx(single, rel=FSDP_RTOL)
    n_experts = task.model.backbone.n_experts
    assert distributed[variant + "_local_experts"] == n_experts // 2, "each rank holds half of the experts"
    bias = task.model.backbone.layers[1].ffn.router.expert_bias.tolist()
    assert any(b != 0 for b in bias), "the aux-free bias never moved: the comparison proves little"
    assert distributed[variant + "_expert_bias"] == pytest.approx(bias, abs=1e-6)


if __name__ == "__main__":
    main(sys.argv[1])
