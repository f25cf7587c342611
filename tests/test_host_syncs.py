"""Host-device synchronizations in the steady-state step (counted with ``tests/host_syncs.py``): none at any stage in
fp32 and bf16-mixed (stage 3 with the divergence check off, its default on GPUs). Which parameters got a gradient on
some rank is decided without reading the exchanged flags when every parameter got one on this rank (Note [unused
parameters]); a rank that saw a parameter without one reads them once per step, and so does fp16's overflow check.
Separate fp32 masters on the device adopt edits by a masked copy, without a read (Note [edits reach the masters])."""

from __future__ import annotations

import inspect
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_zero import ZeroConfig, ZeroOptimizer, shard_module
from lightning_zero.sharding.loss_scaler import DynamicLossScaler
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
def test_stages_1_and_2_step_without_host_syncs(stage, accumulate):
    for where in run_distributed(_steady_state_syncs, 2, stage, accumulate):
        assert where == []


def _mixed_precision_syncs(cases: list[tuple[int, str]]) -> dict[str, dict[str, object]]:
    return {f"stage{stage} {precision}": _mixed_precision_case(stage, precision) for stage, precision in cases}


def _mixed_precision_case(stage: int, precision: str) -> dict[str, object]:
    """The host reads of two steady steps, then of a step after an edit through ``p.data`` (what no version counter
    sees), and whether the edit was found (read after counting)."""
    rank = dist.get_rank()
    dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float16
    model = build_model("gpt").to(dtype)
    config = ZeroConfig(stage=stage, check_rank_divergence=False)  # as on a GPU
    gatherer = shard_module(model, config, dist.group.WORLD, torch.device("cpu")) if stage == 3 else None
    scaler = DynamicLossScaler(scale=2.0**4) if dtype == torch.float16 else None
    inner = build_optimizer("adamw", model)
    optimizer = ZeroOptimizer(model, inner, dist.group.WORLD, config, gatherer, loss_scaler=scaler)

    def step(index: int) -> None:
        loss = loss_fn("gpt", model, batch("gpt", rank, index, 0)).float()
        (loss * (scaler.scale if scaler is not None else 1.0)).backward()
        optimizer.step()
        optimizer.zero_grad()

    step(0)  # warm-up: lazily created optimizer state, first-step checks
    with count_host_syncs() as steady:
        for index in range(1, 3):
            step(index)
    with gatherer.gathered(writeback=True) if gatherer is not None else nullcontext(), torch.no_grad():
        for param in model.parameters():
            param.data.mul_(0.5)  # through .data: no version counter moves
    with count_host_syncs() as after_edit:
        step(3)
    return {"steady": steady.where, "after_edit": after_edit.where, "flagged": optimizer.edits.flagged}


@pytest.mark.timeout(150)
def test_mixed_precision_steps_read_only_the_fp16_overflow_flag():
    """bf16-mixed: no host read in a steady step, nor in one whose parameters were edited (the masters adopt edits
    by a masked copy on the device); 16-mixed: one, the overflow flag (torch's optimizers skip a step on the host).
    Stages 1-3, the edit found every time."""
    lines, first = inspect.getsourcelines(ZeroOptimizer.step)
    reduce_line = first + next(i for i, line in enumerate(lines) if "self.reduce_gradients()" in line)
    overflow_read = f"Tensor.tolist at {inspect.getsourcefile(ZeroOptimizer)}:{reduce_line} step "
    cases = [(s, p) for s in (1, 2, 3) for p in ("bf16-mixed", "16-mixed")]
    for runs in run_distributed(_mixed_precision_syncs, 2, cases, timeout=130):
        for name, run in runs.items():
            reads = 0 if "bf16" in name else 1
            assert len(run["steady"]) == 2 * reads, (name, run["steady"])
            assert len(run["after_edit"]) == reads, (name, run["after_edit"])
            assert all(w.startswith(overflow_read) for w in run["steady"] + run["after_edit"]), (name, run)
            assert run["flagged"] > 0, name  # the edit was adopted by the masked copy


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
def test_stage3_steps_without_host_syncs_when_the_divergence_check_is_off():
    # Off is what ZeroConfig(check_rank_divergence=None) resolves to on a GPU.
    assert ZeroConfig(stage=3).checks_rank_divergence_on(torch.device("cuda", 0)) is False
    for where in run_distributed(_stage3_steady_state_syncs, 2, False):
        assert where == []


@pytest.mark.timeout(120)
def test_stage3_divergence_check_reads_one_exchange_per_gather():
    assert ZeroConfig(stage=3).checks_rank_divergence_on(torch.device("cpu")) is True
    for where in run_distributed(_stage3_steady_state_syncs, 2, True):
        checks = [w for w in where if "parameter_gatherer.py" in w]
        assert checks, "the check must read the exchanged unit indices"
        assert [w for w in where if w not in checks] == []


class _Branches(nn.Module):
    """Rank 1 never calls ``unused_on_rank_1``; rank 0 calls both branches."""

    def __init__(self) -> None:
        super().__init__()
        self.always = nn.Linear(4, 4)
        self.unused_on_rank_1 = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.always(x)
        return y + self.unused_on_rank_1(x) if dist.get_rank() == 0 else y


def _syncs_per_rank(stage: int, precision: str) -> dict[str, object]:
    torch.manual_seed(0)
    dtype = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}.get(precision, torch.float32)
    model = _Branches().to(dtype)
    config = ZeroConfig(stage=stage, bucket_numel=20, check_rank_divergence=False)  # as on a GPU
    gatherer = shard_module(model, config, dist.group.WORLD, torch.device("cpu")) if stage == 3 else None
    scaler = DynamicLossScaler(scale=2.0**4) if dtype == torch.float16 else None
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer = ZeroOptimizer(
        model, inner, dist.group.WORLD, config, gatherer, fp32_masters=dtype != torch.float32, loss_scaler=scaler
    )

    def step() -> None:
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(dist.get_rank())).to(dtype)
        (model(x).float().square().mean() * (scaler.scale if scaler is not None else 1.0)).backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    before = [m.detach().clone() for m in optimizer.masters]
    with count_host_syncs() as syncs:
        for _ in range(2):
            step()
    return {
        "where": syncs.where,
        "moved": [not torch.equal(b, m) for b, m in zip(before, optimizer.masters, strict=True)],
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("stage", "precision"), [(1, "32-true"), (3, "32-true"), (2, "bf16-mixed")])
def test_only_a_rank_missing_a_gradient_reads_the_flags(stage, precision):
    # Rank 0 had every gradient: each parameter was used on some rank, nothing to read. Rank 1 lacks the branch it
    # skipped: it reads the summed flags (once per step) to learn that rank 0 used it, and steps it as DDP would.
    # bf16-mixed adds nothing: its masters adopt edits without a read (Note [edits reach the masters]).
    rank0, rank1 = run_distributed(_syncs_per_rank, 2, stage, precision)
    assert len(rank0["where"]) == 0, rank0["where"]
    assert len(rank1["where"]) == 2, rank1["where"]
    for run in (rank0, rank1):
        assert run["moved"], "this rank steps no shard"
        assert all(run["moved"]), run["moved"]  # every parameter stepped, as under DDP


@pytest.mark.timeout(120)
def test_fp16_reads_the_overflow_check_with_the_used_flags_once_per_step():
    for run in run_distributed(_syncs_per_rank, 2, 2, "16-mixed"):
        assert len(run["where"]) == 2, run["where"]  # the overflow flag, one read with the used flags
