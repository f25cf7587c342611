"""No host-device synchronization in the steady-state step of stages 1 and 2 (counted with ``tests/host_syncs.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_zero import ZeroConfig, ZeroOptimizer
from tests.harness import run_distributed
from tests.host_syncs import count_host_syncs
from tests.parity import batch, build_model, build_optimizer, loss_fn


def test_the_counter_sees_item_bool_and_tolist():
    x = torch.arange(3.0)
    with count_host_syncs() as syncs:
        x.sum().item()
        if x[0] > 1:
            pass
        x.tolist()
        x.add(1)  # no sync
    assert syncs.count == 3, syncs.where
    assert torch.Tensor.tolist(x) == [0.0, 1.0, 2.0]  # restored


def test_the_counter_leaves_out_the_optimizers_host_side_step_counter():
    weight = torch.nn.Parameter(torch.ones(3))
    adam = torch.optim.Adam([weight])
    weight.grad = torch.ones(3)
    with count_host_syncs() as syncs:
        adam.step()  # reads its host-side `step` tensor with .item()
        weight.grad.sum().item()
    assert syncs.count == 1, syncs.where


def _steady_state_syncs(stage: int, accumulate: int) -> list[str]:
    model = build_model("gpt")
    optimizer = ZeroOptimizer(model, build_optimizer("adamw", model), dist.group.WORLD, ZeroConfig(stage=stage))
    rank = dist.get_rank()

    def step(index: int) -> None:
        for micro in range(accumulate):
            context = optimizer.no_sync() if micro < accumulate - 1 else torch.enable_grad()
            with context:
                (loss_fn("gpt", model, batch("gpt", rank, index, micro)) / accumulate).backward()
        optimizer.step()
        optimizer.zero_grad()

    step(0)  # warm-up: lazily created optimizer state, first-step checks
    with count_host_syncs() as syncs:
        for index in range(1, 3):
            step(index)
    return syncs.where


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_stages_1_and_2_step_without_host_syncs(stage, accumulate):
    for where in run_distributed(_steady_state_syncs, 2, stage, accumulate):
        assert where == []
