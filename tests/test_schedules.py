"""zoo.tasks.schedules as a specification: the warm-up + cosine schedule takes its length as a number or as
a callable resolved at the first step that needs it (Lightning#20550), with the same rates either way."""

from __future__ import annotations

import io
import math

import pytest
import torch

from zoo.tasks.schedules import warmup_cosine


def rates(total, steps: int, warmup: int = 3, floor: float = 0.1) -> list[float]:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = warmup_cosine(optimizer, warmup, total, floor)["lr_scheduler"]["scheduler"]
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


def test_a_lazy_total_gives_exactly_the_rates_of_the_same_total_given_up_front():
    assert rates(lambda: 12, 14) == rates(12, 14)
    assert rates(lambda: 12, 14, warmup=0) == rates(12, 14, warmup=0)


def test_the_schedule_warms_up_linearly_then_decays_to_the_floor():
    lr = rates(10, 12, warmup=2, floor=0.1)
    assert lr[:3] == [0.5, 1.0, 1.0]  # the cosine starts at its peak at step W
    assert all(a > b for a, b in zip(lr[2:10], lr[3:11], strict=True))
    assert lr[10] == pytest.approx(0.1) and lr[11] == pytest.approx(0.1)


def test_a_lazy_total_is_not_read_while_the_scheduler_is_built():
    asked = []

    def total() -> int:
        asked.append(True)
        return 8

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = warmup_cosine(optimizer, 2, total, 0.0)["lr_scheduler"]["scheduler"]
    assert not asked  # configure_optimizers must not read estimated_stepping_batches (Lightning#20550)
    optimizer.step()
    scheduler.step()
    scheduler.step()
    assert asked == [True]  # once, then remembered


def test_the_scheduler_state_saves_no_code_and_loads_with_weights_only():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = warmup_cosine(optimizer, 2, lambda: 8, 0.0)["lr_scheduler"]["scheduler"]
    optimizer.step()
    scheduler.step()
    buffer = io.BytesIO()
    torch.save(scheduler.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert state["lr_lambdas"] == [None] and state["last_epoch"] == 1


def test_a_run_without_a_step_or_epoch_limit_holds_the_peak_rate_after_warm_up_and_says_so():
    with pytest.warns(UserWarning, match="only max_time"):
        lr = rates(lambda: math.inf, 6, warmup=2)
    assert lr == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]
