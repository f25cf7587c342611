"""ZeroOptimizer beyond the plain loop: data-dependent unused parameters, repeated backward, bad input."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_zero import ZeroConfig, ZeroOptimizer
from tests.harness import run_distributed


class Branchy(nn.Module):
    """Takes one of two branches depending on the data, so ranks leave different parameters without gradient."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.stem = nn.Linear(8, 16)
        self.left = nn.Linear(16, 4)
        self.right = nn.Linear(16, 4)
        self.never = nn.Linear(16, 4)  # trainable but never used

    def forward(self, x: torch.Tensor, go_left: bool) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        return self.left(h) if go_left else self.right(h)


def _branchy(stage: int, backwards_per_step: int) -> list[dict[str, torch.Tensor]]:
    rank = dist.get_rank()
    results = []
    for use_zero in (False, True):
        model = Branchy()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if use_zero:
            forward: nn.Module = model
            optimizer = ZeroOptimizer(model, optimizer, dist.group.WORLD, ZeroConfig(stage=stage, bucket_numel=50))
        else:
            forward = DistributedDataParallel(model, find_unused_parameters=True)
        for step in range(6):
            optimizer.zero_grad()
            for micro in range(backwards_per_step):
                g = torch.Generator().manual_seed(100 * rank + 10 * step + micro)
                x = torch.randn(5, 8, generator=g)
                go_left = (rank + step + micro) % 2 == 0  # differs across ranks within a step
                forward(x, go_left).square().mean().backward()  # sync on every backward, no no_sync()
            optimizer.step()  # `never` has no gradient on any rank: skipped by both (Note [unused parameters])
        results.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return results


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("backwards_per_step", [1, 2])
def test_rank_dependent_unused_parameters_and_repeated_backward_match_ddp(stage, backwards_per_step):
    for reference, sharded in run_distributed(_branchy, 2, stage, backwards_per_step):
        for name, expected in reference.items():
            torch.testing.assert_close(sharded[name], expected, rtol=1e-5, atol=1e-6, msg=name)


def _stage1_module_zero_grad() -> list[torch.Tensor]:
    """``module.zero_grad()`` sets ``.grad`` to None behind the flat buffers' back; the next step must be right."""
    out = []
    for use_zero in (False, True):
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        if use_zero:
            optimizer = ZeroOptimizer(model, optimizer, dist.group.WORLD, ZeroConfig(stage=1))
            forward: nn.Module = model
        else:
            forward = DistributedDataParallel(model)
        for step in range(3):
            model.zero_grad(set_to_none=True)
            forward(torch.full((2, 4), float(step + dist.get_rank()))).sum().backward()
            optimizer.step()
        out.append(model.weight.detach().clone())
    return out


@pytest.mark.timeout(60)
def test_stage1_survives_module_zero_grad_set_to_none():
    for reference, sharded in run_distributed(_stage1_module_zero_grad, 2):
        torch.testing.assert_close(sharded, reference)


def _sharing_param_groups(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    # torch's optimizers refuse this at construction; other optimizers may not, and editing groups afterwards can.
    optimizer = torch.optim.SGD([{"params": params[:3]}, {"params": params[3:]}], lr=0.1)
    optimizer.param_groups[1]["params"].append(params[2])
    return optimizer


def _construction_error(case: str) -> str:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    params = list(model.parameters())
    optimizers = {
        "frozen": lambda: torch.optim.SGD([p.requires_grad_(False) for p in params], lr=0.1),
        "shared": lambda: _sharing_param_groups(params),
        "lbfgs": lambda: torch.optim.LBFGS(params),
        "foreign": lambda: torch.optim.SGD([*params, nn.Parameter(torch.zeros(3, 5))], lr=0.1),
    }
    try:
        ZeroOptimizer(model, optimizers[case](), dist.group.WORLD, ZeroConfig())
    except (TypeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("frozen", r"ValueError: SGD has no trainable parameters to shard.*HINT: pass the model's trainable"),
        ("shared", r"ValueError: Parameter '1.weight' appears in param group 0 and again in param group 1.*HINT"),
        ("lbfgs", r"TypeError: LBFGS cannot be sharded by ZeRO.*HINT: use an element-wise optimizer"),
        ("foreign", r"ValueError: Param group 0 of SGD holds a tensor of shape \(3, 5\) that is not a parameter"),
    ],
)
def test_bad_optimizers_are_refused_with_the_fix(case, expected):
    (message,) = run_distributed(_construction_error, 1, case)
    assert message != "no error"
    assert re.search(expected, message), message


def _chunked_step() -> tuple[int, int, bool, bool]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    calls = []
    inner.register_step_pre_hook(lambda opt, args, kwargs: calls.append(len(opt.param_groups[0]["params"])))
    optimizer = ZeroOptimizer(model, inner, dist.group.WORLD, ZeroConfig(stage=2, bucket_numel=100))
    masters = list(optimizer.masters)
    reference = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    reference.load_state_dict(model.state_dict())
    ddp = DistributedDataParallel(reference)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(3):
        model(x).square().mean().backward()
        optimizer.step()
        ddp(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    restored = inner.param_groups[0]["params"] == masters  # the narrowed groups were put back
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))
    return len(optimizer.buckets), len(calls), restored, same


@pytest.mark.timeout(60)
def test_the_step_runs_bucket_by_bucket_and_matches_ddp():
    for buckets, calls, restored, same in run_distributed(_chunked_step, 2):
        assert buckets > 1
        assert calls == 3  # one inner step per bucket, but its step hooks once per step (Note [step hooks])
        assert restored
        assert same


def _stage3_step_sizes(world_bucket: int) -> tuple[int, int, int, bool]:
    """Elements the user's optimizer steps per call at stage 3 (its multi-tensor temporaries scale with them)."""
    from lightning_zero import shard_module

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(32, 32) for _ in range(4)))
    reference = nn.Sequential(*(nn.Linear(32, 32) for _ in range(4)))
    reference.load_state_dict(model.state_dict())
    config = ZeroConfig(stage=3, bucket_numel=world_bucket, wrap_min_numel=1)
    gatherer = shard_module(model, config, dist.group.WORLD, torch.device("cpu"))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    sizes: list[int] = []  # elements of each multi-tensor sqrt of the second moments: Adam's largest temporary
    foreach_sqrt = torch._foreach_sqrt

    def counted(tensors: Any) -> Any:
        if recording:
            sizes.append(sum(t.numel() for t in tensors))
        return foreach_sqrt(tensors)

    recording = False

    torch._foreach_sqrt = counted  # this rank's process only
    calls: list[int] = []
    inner.register_step_post_hook(lambda opt, *_: calls.append(1))
    optimizer = ZeroOptimizer(model, inner, dist.group.WORLD, config, gatherer)
    ddp = DistributedDataParallel(reference)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, foreach=True)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(2):
        model(x).square().mean().backward()
        recording = True
        optimizer.step()
        recording = False
        optimizer.zero_grad()
        ddp(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    torch._foreach_sqrt = foreach_sqrt
    shard = sum(m.numel() for m in optimizer.masters)
    with gatherer.gathered():
        same = all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))
    return max(sizes), shard, len(calls), same


@pytest.mark.timeout(60)
def test_stage3_steps_one_bucket_at_a_time_so_optimizer_temporaries_stay_bucket_sized():
    # Note [step in chunks]: a multi-tensor Adam allocates temporaries as large as one call's parameters.
    for largest_call, shard, calls, same in run_distributed(_stage3_step_sizes, 2, 1_056):
        assert largest_call <= 1_056 // 2, (largest_call, shard)  # a bucket's shard on 2 ranks, not the whole shard
        assert shard > largest_call
        assert calls == 2  # step hooks: once per step (Note [step hooks])
        assert same
