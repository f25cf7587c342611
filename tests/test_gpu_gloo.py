"""Two ranks sharing one GPU over gloo: multi-rank parity with DDP on a machine with one GPU (``gpu`` marker).

NCCL refuses two ranks on one device, so on such a machine the multi-rank paths run over gloo with CUDA tensors.
Gloo runs its collectives on CUDA tensors, but its point-to-point sends abort the rank (seen on torch 2.11), so ZeRO
takes the native forms for CUDA tensors on gloo by itself (Note [native collectives]). ``gloo_cuda_probe`` measures
which collectives run; the parity test runs when the native ones do, else skips saying what failed.
``scripts/gpu_check.sh`` records the probe's table too.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_zero import ZeroConfig, ZeroOptimizer, shard_module
from lightning_zero.comm.collectives import NATIVE_COLLECTIVES_ENV
from tests.harness import run_distributed
from tests.parity import batch, build_model, build_optimizer, full_weights, loss_fn
from tests.test_gpu import RANKS_TIMEOUT, STEPS, TEST_TIMEOUT, assert_matches

pytestmark = pytest.mark.gpu


def gloo_cuda_probe(device_type: str = "cuda", report: Callable[[str, str], None] | None = None) -> dict[str, str]:
    """Which collectives gloo runs on tensors of ``device_type`` (rank 0's GPU for every rank): "ok" or the error.
    Runs in each of 2 ranks of a gloo group (``run_distributed``'s default); ``report(op, outcome)`` is called as
    each is known (``scripts/gpu_check.sh`` keeps them, should a later one crash the rank)."""
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device(device_type)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.full((8,), float(rank + 1), device=device)

    ones = [torch.full((8,), float(r + 1), device=device) for r in range(world)]  # every rank's x
    total = sum(r + 1 for r in range(world))

    def all_reduce() -> bool:
        y = x.clone()
        dist.all_reduce(y)
        return bool((y == total).all())

    def broadcast() -> bool:
        y = x.clone()
        dist.broadcast(y, 0)
        return bool((y == 1).all())

    def all_gather_into_tensor() -> bool:
        out = torch.empty(8 * world, device=device)
        dist.all_gather_into_tensor(out, x)
        return torch.equal(out, torch.cat(ones))

    def all_gather() -> bool:
        out = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(out, x)
        return all(torch.equal(a, b) for a, b in zip(out, ones, strict=True))

    def reduce_scatter_tensor() -> bool:
        out = torch.empty(8 // world, device=device)
        dist.reduce_scatter_tensor(out, x)
        return bool((out == total).all())

    def all_to_all_single() -> bool:
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x)
        return torch.equal(out, torch.cat([t[rank * 8 // world : (rank + 1) * 8 // world] for t in ones]))

    def isend_irecv() -> bool:
        if device.type == "cuda":  # not a Python error: the rank dies with SIGABRT (Note [native collectives])
            raise NotImplementedError("not run: gloo's isend of a CUDA tensor aborts the rank (torch 2.11)")
        peer = 1 - rank
        out = torch.empty_like(x)
        for work in (dist.isend(x, peer, tag=3), dist.irecv(out, peer, tag=3)):
            assert work is not None
            work.wait()
        return torch.equal(out, ones[peer])

    checks = [all_reduce, broadcast, all_gather_into_tensor, all_gather, reduce_scatter_tensor, all_to_all_single,
              isend_irecv]  # fmt: skip
    result = {}
    for check in checks:
        name = check.__name__
        try:
            right = check()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            result[name] = "ok" if right else "wrong values"
        except Exception as error:  # what fails is what we measure
            result[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
        if report is not None:
            report(name, result[name])
        dist.barrier()
    return result


def gloo_cuda_mode(probe: dict[str, str]) -> str | None:
    """Whether ZeRO's collectives can run over gloo on CUDA tensors: the native forms, which ZeRO takes for CUDA
    tensors on gloo (Note [native collectives]), or not at all (None)."""
    needed = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor")  # DDP's, flags, ZeRO's
    return "native" if all(probe[op] == "ok" for op in needed) else None


def _core_train(config: ZeroConfig | None, device: torch.device) -> dict[str, Any]:
    """DDP (``config`` None) or ZeRO at the core level on ``device``, on the parity tests' model and batches."""
    model = build_model("gpt").to(device)
    optimizer: Any = build_optimizer("adamw", model)
    forward: torch.nn.Module = model
    if config is None:
        forward = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    else:
        gatherer = shard_module(model, config, dist.group.WORLD, device) if config.stage == 3 else None
        optimizer = ZeroOptimizer(model, optimizer, dist.group.WORLD, config, gatherer)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        x, y = (t.to(device) for t in batch("gpt", dist.get_rank(), step, 0))
        loss = loss_fn("gpt", forward, (x, y))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    weights = {n: w.float().cpu() for n, w in full_weights(model, optimizer).items()}
    return {"losses": losses, "weights": weights}


def _gloo_parity(device_type: str = "cuda") -> list[dict[str, Any]]:
    """Rank 0's GPU for both ranks (``device_type`` "cpu": the same runs on the CPU, to check this file there).
    The environment's switch is off: ZeRO must take the native forms for CUDA tensors on gloo by itself."""
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.pop(NATIVE_COLLECTIVES_ENV, None)
    zero = [ZeroConfig(stage=s, bucket_numel=4_000) for s in (1, 2, 3)]
    return [_core_train(None, device)] + [_core_train(config, device) for config in zero]


@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.gpus(1)
def test_two_ranks_sharing_one_gpu_over_gloo_match_ddp():
    probe = run_distributed(gloo_cuda_probe, 2, timeout=90)[0]
    mode = gloo_cuda_mode(probe)
    if mode is None:
        pytest.skip(f"gloo on this torch does not run ZeRO's collectives on CUDA tensors: {probe}")
    for reference, *runs in run_distributed(_gloo_parity, 2, timeout=RANKS_TIMEOUT):
        for stage, run in enumerate(runs, start=1):
            assert_matches(run, reference, "32-true", f"stage {stage} over gloo ({mode} collectives)")
