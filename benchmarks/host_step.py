"""The memory tiers' optimizer step against torch's fused AdamW and DeepSpeed's ``DeepSpeedCPUAdam``, paired in one run.

    .venv/bin/python benchmarks/host_step.py --rounds 15 --deepspeed-python /path/to/deepspeed-venv/bin/python \\
        --out benchmarks/results/host_step.json

The tiers step on host memory (Note [tier step kernels] in ``lightning_zero/offload/optimizer_tiers.py``), where an
Adam step is as fast as its memory traffic. Every variant updates the same number of fp32 parameters (``--params``)
with AdamW, one thread, and is timed from the call to the end of the step:

- ``tier``: ours, ``ZeroOptimizer.step()`` at stage 2 (one rank) with ``offload_optimizer="cpu"``, buckets of
  ``--bucket`` elements stepped one at a time as the tiers step them, with the kernels the tiers choose for an
  ``AdamW`` whose kernels the user left to torch (fused);
- ``tier_foreach``: the same with ``foreach=True`` (what the host tier chose before it took the fused kernels);
- ``torch_fused``: ``torch.optim.AdamW(fused=True)`` on tensors of the sizes of ours (one per parameter, as the
  tiers' masters are), in one ``step()``;
- ``deepspeed``: ``DeepSpeedCPUAdam`` (``adamw_mode=True``) on the same tensors, in a worker process of another
  Python environment (``--deepspeed-python``; DeepSpeed is a peer, never a dependency) that steps when told to.

A round is one step of each variant, in an order rotated every round; each variant's ratio to ``torch_fused`` is
taken within the round, so the drift of a shared machine cancels out, and the table shows the median ratio over the
rounds with its spread (the quartiles and the extremes). In a round each variant takes ``--steps`` steps in a row
and its fastest counts (the least disturbed by other processes); wall time and the stepping thread's CPU time are
both reported. Before each step of each variant a backward runs (not timed): ours, which gives ``tier`` and
``tier_foreach`` their gradients, and the same before the others' steps, which all follow the same memory traffic.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_zero import ZeroConfig, ZeroOptimizer
from lightning_zero.offload.memory_tiers import MemoryTiers

_WORKER = r"""
import os, sys, time
os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam
torch.set_num_threads(1)
sizes = [int(n) for n in sys.argv[1:]]
gen = torch.Generator().manual_seed(0)
params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]
for p in params:
    p.grad = torch.randn(p.shape, generator=gen) * 1e-2
optimizer = DeepSpeedCPUAdam(params, lr=1e-3, weight_decay=0.01, adamw_mode=True)
print("ready", flush=True)
for line in sys.stdin:
    start, cpu = time.perf_counter(), time.thread_time()
    optimizer.step()
    print(time.perf_counter() - start, time.thread_time() - cpu, flush=True)
"""


_Step = Callable[[], tuple[float, float]]
"""One step of a variant, timed: (wall seconds, CPU seconds of the stepping thread)."""


class _DeepSpeedWorker:
    """``DeepSpeedCPUAdam`` in another Python environment; ``step()`` returns its step's seconds (wall, CPU)."""

    def __init__(self, python: str, sizes: list[int]) -> None:
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen(
            [python, "-c", _WORKER, *map(str, sizes)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        assert self.process.stdout is not None
        assert self.process.stdin is not None
        self._out, self._in = self.process.stdout, self.process.stdin
        line = self._out.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"the DeepSpeed worker did not start (said {line!r}); see its stderr above")

    def step(self) -> tuple[float, float]:
        self._in.write("step\n")
        self._in.flush()
        wall, cpu = self._out.readline().split()
        return float(wall), float(cpu)

    def close(self) -> None:
        self._in.close()
        self.process.wait(timeout=60)


def _layers(params: int, bucket: int) -> nn.Module:
    """Square linear layers without bias, four to a bucket, ``params`` parameters in all."""
    width = int((bucket // 4) ** 0.5)
    count = max(1, round(params / (width * width)))
    return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(count)])


def _tier(params: int, bucket: int, options: dict[str, Any]) -> tuple[Callable[[], None], _Step, ZeroOptimizer]:
    """Ours: ``ZeroOptimizer.step()`` with the optimizer's host tier; a backward (the gradients of the next step),
    and a function that times one step."""
    torch.manual_seed(0)
    model = _layers(params, bucket)
    group = dist.group.WORLD
    assert group is not None
    config = ZeroConfig(stage=2, offload_optimizer="cpu", bucket_numel=bucket)
    tiers = MemoryTiers(config, None, io_entries=2)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, **options)
    optimizer = ZeroOptimizer(model, adamw, group, config, tiers=tiers.for_optimizer())
    width = model[0].in_features
    batch = torch.randn(2, width)

    def backward() -> None:
        optimizer.zero_grad()
        model(batch).square().mean().backward()

    def step() -> tuple[float, float]:
        start, cpu = time.perf_counter(), time.thread_time()
        optimizer.step()
        return time.perf_counter() - start, time.thread_time() - cpu

    return backward, step, optimizer


def _torch_fused(sizes: list[int]) -> _Step:
    gen = torch.Generator().manual_seed(0)
    tensors = [nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]
    for t in tensors:
        t.grad = torch.randn(t.shape, generator=gen) * 1e-2
    adamw = torch.optim.AdamW(tensors, lr=1e-3, weight_decay=0.01, fused=True)

    def step() -> float:
        start, cpu = time.perf_counter(), time.thread_time()
        adamw.step()
        return time.perf_counter() - start, time.thread_time() - cpu

    return step


def _kernels(optimizer: ZeroOptimizer) -> str:
    group = optimizer.optimizer.param_groups[0]
    return "fused" if group.get("fused") else "foreach" if group.get("foreach") else "single-tensor"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=50_000_000)
    parser.add_argument("--bucket", type=int, default=4_000_000)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="steps of each variant per round (the fastest counts)")
    parser.add_argument("--deepspeed-python", help="a Python with deepspeed installed (its own environment)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            results = _measure(args)
        finally:
            dist.destroy_process_group()
    _report(args, results)


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    tier_backward, tier, fused_tier = _tier(args.params, args.bucket, {})
    foreach_backward, tier_foreach, foreach_tier = _tier(args.params, args.bucket, {"foreach": True})
    sizes = [m.numel() for m in fused_tier.masters]  # the same tensors for every variant: one per parameter
    variants: dict[str, _Step] = {
        "tier": tier,
        "tier_foreach": tier_foreach,
        "torch_fused": _torch_fused(sizes),
    }
    worker = _DeepSpeedWorker(args.deepspeed_python, sizes) if args.deepspeed_python else None
    if worker is not None:
        variants["deepspeed"] = worker.step
    # Before each step, the backward that gives ours its gradients; the same one before the others' steps (another
    # model's, not timed), so that every variant steps after the same traffic through the caches.
    before = {name: tier_backward if name == "tier" else foreach_backward for name in variants}
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu_times: dict[str, list[float]] = {name: [] for name in names}
    try:
        for round_ in range(args.warmup + args.rounds):
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            steps = {name: [(before[name](), variants[name]())[1] for _ in range(args.steps)] for name in order}
            if round_ >= args.warmup:  # the fastest of a variant's steps in the round: the least disturbed
                for name in names:
                    times[name].append(min(wall for wall, _ in steps[name]))
                    cpu_times[name].append(min(cpu for _, cpu in steps[name]))
    finally:
        if worker is not None:
            worker.close()
    return {
        "params": sum(sizes),
        "buckets": len(fused_tier.buckets),
        "tensors": sizes,
        "kernels": {"tier": _kernels(fused_tier), "tier_foreach": _kernels(foreach_tier)},
        "times": times,
        "cpu_times": cpu_times,
    }


def _spread(values: list[float]) -> dict[str, float]:
    q1, _, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
    return {"median": statistics.median(values), "q1": q1, "q3": q3, "min": min(values), "max": max(values)}


def _report(args: argparse.Namespace, results: dict[str, Any]) -> None:
    rows = []
    summary: dict[str, Any] = {}
    for clock in ("times", "cpu_times"):
        times: dict[str, list[float]] = results[clock]
        base = times["torch_fused"]
        for name, values in times.items():
            ratios = [v / b for v, b in zip(values, base, strict=True)]
            record = {"seconds": _spread(values), "ratio_to_torch_fused": _spread(ratios)}
            summary.setdefault(name, {})[clock] = record
            r = record["ratio_to_torch_fused"]
            ns_per_param = statistics.median(values) / results["params"] * 1e9
            rows.append(
                f"| {name} | {'wall' if clock == 'times' else 'CPU'} | {statistics.median(values) * 1e3:.1f} "
                f"| {ns_per_param:.2f} | {r['median']:.3f} | {r['q1']:.3f}-{r['q3']:.3f} "
                f"| {r['min']:.3f}-{r['max']:.3f} |"
            )
    print(
        f"AdamW step, {results['params']:,} fp32 parameters ({len(results['tensors'])} tensors) in "
        f"{results['buckets']} buckets, one thread, "
        f"{args.rounds} paired rounds; tier kernels: {results['kernels']}"
    )
    print("| variant | clock | median ms/step | ns/param | ratio to torch_fused (median) | quartiles | min-max |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {"argv": sys.argv, **results, "summary": summary}
        args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
