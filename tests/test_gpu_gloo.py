"""Two ranks sharing one GPU over gloo: multi-rank parity with DDP on a machine with one GPU (``gpu`` marker).

NCCL refuses two ranks on one device, so on such a machine the multi-rank paths run over gloo with CUDA tensors.
Gloo runs only some collectives on CUDA tensors; ``gloo_cuda_probe`` measures which, and the parity test takes
ZeRO's gloo forms (pairwise sends), else the native ones (Note [native collectives]), else skips saying what failed.
``scripts/gpu_check.sh`` records the probe's table too.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_zero import ZeroConfig, ZeroOptimizer, shard_module
from lightning_zero.comm.collectives import NATIVE_COLLECTIVES_ENV
from tests.harness import run_distributed
from tests.parity import batch, build_model, build_optimizer, full_weights, loss_fn
from tests.test_gpu import STEPS, assert_matches

pytestmark = pytest.mark.gpu


def gloo_cuda_probe(device_type: str = "cuda") -> dict[str, str]:
    """Which collectives gloo runs on tensors of ``device_type`` (rank 0's GPU for every rank): "ok" or the error.
    Runs in each of 2 ranks of a gloo group (``run_distributed``'s default). ``scripts/gpu_check.sh`` records it."""
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device(device_type)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.full((8,), float(rank + 1), device=device)

    def p2p() -> None:
        peer = 1 - rank
        out = torch.empty_like(x)
        for work in (dist.isend(x, peer, tag=3), dist.irecv(out, peer, tag=3)):
            work.wait()
        assert out[0].item() == peer + 1

    checks = {
        "all_reduce": lambda: dist.all_reduce(x.clone()),
        "broadcast": lambda: dist.broadcast(x.clone(), 0),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty(8 * world, device=device), x),
        "all_gather": lambda: dist.all_gather([torch.empty_like(x) for _ in range(world)], x),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.empty(8 // world, device=device), x),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.empty_like(x), x),
        "isend_irecv": p2p,
    }
    result = {}
    for name, check in checks.items():
        try:
            check()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            result[name] = "ok"
        except Exception as error:  # what fails is what we measure
            result[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
        dist.barrier()
    return result


def gloo_cuda_mode(probe: dict[str, str]) -> str | None:
    """How ZeRO's collectives can run over gloo on CUDA tensors: gloo's own forms (pairwise sends), the native ones
    (Note [native collectives]), or not at all (None)."""
    if any(probe[op] != "ok" for op in ("all_reduce", "broadcast")):  # DDP's and the flags' collectives
        return None
    if probe["isend_irecv"] == "ok":
        return "gloo"
    if probe["all_gather_into_tensor"] == "ok" and probe["reduce_scatter_tensor"] == "ok":
        return "native"
    return None


def _core_train(config: ZeroConfig | None) -> dict[str, Any]:
    """DDP (``config`` None) or ZeRO at the core level on rank 0's GPU, on the parity tests' model and batches."""
    device = torch.device("cuda", 0)
    model = build_model("gpt").to(device)
    optimizer: Any = build_optimizer("adamw", model)
    forward: torch.nn.Module = model
    if config is None:
        forward = DistributedDataParallel(model, device_ids=[0])
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


def _gloo_parity(native: bool) -> list[dict[str, Any]]:
    torch.cuda.set_device(0)
    if native:
        os.environ[NATIVE_COLLECTIVES_ENV] = "1"
    return [_core_train(None)] + [_core_train(ZeroConfig(stage=s, bucket_numel=4_000)) for s in (1, 2, 3)]


@pytest.mark.timeout(300)
@pytest.mark.gpus(1)
def test_two_ranks_sharing_one_gpu_over_gloo_match_ddp():
    probe = run_distributed(gloo_cuda_probe, 2, timeout=90)[0]
    mode = gloo_cuda_mode(probe)
    if mode is None:
        pytest.skip(f"gloo on this torch does not run ZeRO's collectives on CUDA tensors: {probe}")
    for reference, *runs in run_distributed(_gloo_parity, 2, mode == "native", timeout=200):
        for stage, run in enumerate(runs, start=1):
            assert_matches(run, reference, "32-true", f"stage {stage} over gloo ({mode} collectives)")
