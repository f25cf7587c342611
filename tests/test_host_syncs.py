"""Host-device synchronizations in the steady-state step (counted with ``tests/host_syncs.py``): exactly one per step
at every stage (stage 3 with the divergence check off, its default on GPUs). That one is the decision of which
parameters got a gradient on some rank (Note [unused parameters]): as under DDP, a parameter without one is left out
of the step, and torch's optimizers skip a parameter by looking at ``p.grad is None`` on the host."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_zero import ZeroConfig, ZeroOptimizer, shard_module
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


def _only_the_used_flags(where: list[str], steps: int) -> None:
    assert len(where) == steps, where
    assert all("sharded_optimizer.py" in w and "step" in w for w in where), where


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_stages_1_and_2_step_with_one_host_sync(stage, accumulate):
    for where in run_distributed(_steady_state_syncs, 2, stage, accumulate):
        _only_the_used_flags(where, steps=2)


def _stage3_steady_state_syncs(check: bool | None) -> list[str]:
    model = build_model("gpt")
    config = ZeroConfig(stage=3, check_rank_divergence=check)
    gatherer = shard_module(model, config, dist.group.WORLD, torch.device("cpu"))
    optimizer = ZeroOptimizer(model, build_optimizer("adamw", model), dist.group.WORLD, config, gatherer)
    rank = dist.get_rank()

    def step(index: int) -> None:
        loss_fn("gpt", model, batch("gpt", rank, index, 0)).backward()
        optimizer.step()
        optimizer.zero_grad()

    step(0)  # the first step's rounds read every exchange (Note [data-dependent units])
    with count_host_syncs() as syncs:
        for index in range(1, 3):
            step(index)
    return syncs.where


@pytest.mark.timeout(120)
def test_stage3_steps_with_one_host_sync_when_the_divergence_check_is_off():
    # Off is what ZeroConfig(check_rank_divergence=None) resolves to on a GPU.
    assert ZeroConfig(stage=3).checks_rank_divergence_on(torch.device("cuda", 0)) is False
    for where in run_distributed(_stage3_steady_state_syncs, 2, False):
        _only_the_used_flags(where, steps=2)


@pytest.mark.timeout(120)
def test_stage3_divergence_check_reads_one_exchange_per_gather():
    assert ZeroConfig(stage=3).checks_rank_divergence_on(torch.device("cpu")) is True
    for where in run_distributed(_stage3_steady_state_syncs, 2, True):
        checks = [w for w in where if "parameter_gatherer.py" in w]
        assert checks, "the check must read the exchanged unit indices"
        _only_the_used_flags([w for w in where if w not in checks], steps=2)
