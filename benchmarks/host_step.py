"""The memory tiers' optimizer step against torch's fused AdamW and DeepSpeed's ``DeepSpeedCPUAdam``, paired in one run.

    .venv/bin/python benchmarks/host_step.py --rounds 15 --threads 1,2 \\
        --deepspeed-python /path/to/deepspeed-venv/bin/python --out benchmarks/results/host_step.json

The tiers step on host memory (Note [tier step kernels] in ``lightning_zero/offload/host_adam.py``), where an
Adam step is as fast as its memory traffic. Every variant updates the same number of fp32 parameters (``--params``)
with AdamW, at each of ``--threads`` (torch's intra-op threads; DeepSpeed's OpenMP threads), and is timed from the
call to the end of the step:

- ``tier``: ours, ``ZeroOptimizer.step()`` at stage 2 (one rank) with ``offload_optimizer="cpu"``, buckets of
  ``--bucket`` elements stepped by ``HostAdam`` (Note [bucketed host Adam]) on its worker thread while the next
  bucket is loaded (Note [host step threads]);
- ``tier_buckets``: the same with ``HostSteps(parallel="buckets")``: one worker per thread, each stepping whole
  buckets on one intra-op thread, instead of one worker whose kernel splits each tensor across the threads;
- ``tier_copies``: the same on the host tier's copy path (``host_copies.FORCE_COPIES``: separate host masters and
  gradient buffers, the gradients copied in and the parameters copied out, here by the CPU);
- ``torch_fused``: ``torch.optim.AdamW(fused=True)`` on tensors of the sizes of ours (one per parameter, as the
  tiers' masters are), in one ``step()``;
- ``deepspeed``: ``DeepSpeedCPUAdam`` (``adamw_mode=True``) on the same tensors, in a worker process of another
  Python environment (``--deepspeed-python``; DeepSpeed is a peer, never a dependency) that steps when told to.

A round is one step of each variant at each thread count, in an order rotated every round; each variant's ratio to
``torch_fused`` at the same thread count is taken within the round, so the drift of a shared machine cancels out,
and the table shows the median ratio over the rounds with its spread (the quartiles and the extremes). In a round
each variant takes ``--steps`` steps in a row and its fastest counts (the least disturbed by other processes); wall
time and the process's CPU time are both reported. Before each step of each variant a backward runs (not timed):
ours, which gives ``tier`` and ``tier_copies`` their gradients, and the same before the others' steps.

``--isolate`` runs each variant of a round in a process of its own, one after the other, so only one variant's
state is in memory at a time (a 1B-parameter AdamW holds 16 GB; three side by side do not fit a 24 GiB machine):
each process builds its variant, takes one untimed step (the moments' first touch), then ``--steps`` timed ones,
and exits. Rounds are still paired and rotated; the backward before each step is then the variant's own (``tier``)
or none.
"""

from __future__ import annotations

import argparse
import json
import os
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
from lightning_zero.offload import host_copies
from lightning_zero.offload.memory_tiers import MemoryTiers

_WORKER = r"""
import os, sys, time
import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam
sizes = [int(n) for n in sys.argv[1:]]
gen = torch.Generator().manual_seed(0)
params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]
for p in params:
    p.grad = torch.randn(p.shape, generator=gen) * 1e-2
optimizer = DeepSpeedCPUAdam(params, lr=1e-3, weight_decay=0.01, adamw_mode=True)
print("ready", flush=True)
for line in sys.stdin:
    torch.set_num_threads(int(line.split()[1]))  # DeepSpeed's OpenMP loop takes this thread's count
    start, cpu = time.perf_counter(), time.process_time()
    optimizer.step()
    print(time.perf_counter() - start, time.process_time() - cpu, flush=True)
"""


_Step = Callable[[], tuple[float, float]]
"""One step of a variant, timed: (wall seconds, CPU seconds of the stepping thread)."""


class _DeepSpeedWorker:
    """``DeepSpeedCPUAdam`` in another Python environment; ``step()`` returns its step's seconds (wall, CPU)."""

    def __init__(self, python: str, sizes: list[int]) -> None:
        env = {**os.environ, "DS_ACCELERATOR": "cpu"}
        env.pop("OMP_NUM_THREADS", None)
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
        self._in.write(f"step {torch.get_num_threads()}\n")
        self._in.flush()
        wall, cpu = self._out.readline().split()
        return float(wall), float(cpu)

    def close(self) -> None:
        self._in.close()
        self.process.wait(timeout=60)


def _layers(params: int, bucket: int) -> nn.Module:
    """Square linear layers without bias, four to a bucket, ``params`` parameters in all; the width a multiple of 64,
    as model widths are (a segment of a whole number of 64-byte units joins its neighbours in one kernel call:
    Note [one kernel call per bucket])."""
    width = _width(bucket)
    return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in _sizes(params, bucket)])


def _width(bucket: int) -> int:
    return int((bucket // 4) ** 0.5) // 64 * 64


def _tier(
    params: int, bucket: int, copies: bool, parallel: str = "intra_op"
) -> tuple[Callable[[], None], _Step, ZeroOptimizer]:
    """Ours: ``ZeroOptimizer.step()`` with the optimizer's host tier; a backward (the gradients of the next step),
    and a function that times one step."""
    torch.manual_seed(0)
    model = _layers(params, bucket)
    group = dist.group.WORLD
    assert group is not None
    config = ZeroConfig(stage=2, offload_optimizer="cpu", bucket_numel=bucket)
    host_copies.FORCE_COPIES = copies
    try:
        tiers = MemoryTiers(config, None, io_entries=2)
    finally:
        host_copies.FORCE_COPIES = False
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    optimizer = ZeroOptimizer(model, adamw, group, config, tiers=tiers.for_optimizer())
    for host_steps in tiers.host_steps:
        host_steps.parallel = parallel  # type: ignore[assignment]
    width = model[0].in_features
    batch = torch.randn(2, width)

    def backward() -> None:
        optimizer.zero_grad()
        model(batch).square().mean().backward()

    def step() -> tuple[float, float]:
        for host_steps in tiers.host_steps:  # the worker's threads are the caller's at its start: this round's count
            if host_steps.threads != torch.get_num_threads():
                host_steps.close()
                host_steps.threads = torch.get_num_threads()
        host_copies.FORCE_COPIES = copies  # read as the step takes the copy path
        try:
            start, cpu = time.perf_counter(), time.process_time()
            optimizer.step()
            return time.perf_counter() - start, time.process_time() - cpu
        finally:
            host_copies.FORCE_COPIES = False

    return backward, step, optimizer


def _torch_fused(sizes: list[int]) -> _Step:
    gen = torch.Generator().manual_seed(0)
    tensors = [nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]
    for t in tensors:
        t.grad = torch.randn(t.shape, generator=gen) * 1e-2
    adamw = torch.optim.AdamW(tensors, lr=1e-3, weight_decay=0.01, fused=True)

    def step() -> tuple[float, float]:
        start, cpu = time.perf_counter(), time.process_time()
        adamw.step()
        return time.perf_counter() - start, time.process_time() - cpu

    return step


def _kernels(optimizer: ZeroOptimizer) -> str:
    group = optimizer.optimizer.param_groups[0]
    return "fused" if group.get("fused") else "foreach" if group.get("foreach") else "single-tensor"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=50_000_000)
    parser.add_argument("--bucket", type=int, default=4_000_000)
    parser.add_argument("--threads", default="1", help="comma-separated intra-op thread counts, e.g. 1,2")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="steps of each variant per round (the fastest counts)")
    parser.add_argument("--variants", default="tier,tier_copies,torch_fused,deepspeed")
    parser.add_argument("--deepspeed-python", help="a Python with deepspeed installed (its own environment)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--isolate", action="store_true", help="each variant of a round in its own process")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # an --isolate child: this variant, at --threads
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(_one_variant(args)))
        return
    if args.isolate:
        _report(args, _measure_isolated(args))
        return
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            results = _measure(args)
        finally:
            dist.destroy_process_group()
    _report(args, results)


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    wanted = args.variants.split(",")
    threads = [int(t) for t in args.threads.split(",")]
    tier_backward, tier, tier_optimizer = _tier(args.params, args.bucket, copies=False)
    variants: dict[str, _Step] = {"tier": tier}
    before: dict[str, Callable[[], None]] = {"tier": tier_backward}
    if "tier_buckets" in wanted:
        buckets_backward, tier_buckets, _ = _tier(args.params, args.bucket, copies=False, parallel="buckets")
        variants["tier_buckets"], before["tier_buckets"] = tier_buckets, buckets_backward
    if "tier_copies" in wanted:
        copies_backward, tier_copies, _ = _tier(args.params, args.bucket, copies=True)
        variants["tier_copies"], before["tier_copies"] = tier_copies, copies_backward
    sizes = [m.numel() for m in tier_optimizer.masters]  # the same tensors for every variant: one per parameter
    variants["torch_fused"] = _torch_fused(sizes)
    worker = _DeepSpeedWorker(args.deepspeed_python, sizes) if args.deepspeed_python else None
    if worker is not None:
        variants["deepspeed"] = worker.step
    for name in variants:  # the others step after the same traffic through the caches as ours
        before.setdefault(name, tier_backward)
    names = [f"{name}@{t}" for t in threads for name in variants]
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu_times: dict[str, list[float]] = {name: [] for name in names}
    try:
        for round_ in range(args.warmup + args.rounds):
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            steps = {}
            for label in order:
                name, count = label.split("@")
                torch.set_num_threads(int(count))
                steps[label] = [(before[name](), variants[name]())[1] for _ in range(args.steps)]
            if round_ >= args.warmup:  # the fastest of a variant's steps in the round: the least disturbed
                for label in names:
                    times[label].append(min(wall for wall, _ in steps[label]))
                    cpu_times[label].append(min(cpu for _, cpu in steps[label]))
    finally:
        if worker is not None:
            worker.close()
    return {
        "params": sum(sizes),
        "buckets": len(tier_optimizer.buckets),
        "tensors": sizes,
        "threads": threads,
        "times": times,
        "cpu_times": cpu_times,
        "load_average": os.getloadavg(),
    }


def _sizes(params: int, bucket: int) -> list[int]:
    """The parameter tensors' sizes ``_layers`` builds (every variant steps tensors of these sizes)."""
    width = _width(bucket)
    return [width * width] * max(1, round(params / (width * width)))


def _one_variant(args: argparse.Namespace) -> dict[str, Any]:
    """An ``--isolate`` child: one untimed step, then ``--steps`` timed ones of variant ``--one``."""
    torch.set_num_threads(int(args.threads))
    if args.one == "deepspeed":
        worker = _DeepSpeedWorker(args.deepspeed_python, _sizes(args.params, args.bucket))
        try:
            steps = [worker.step() for _ in range(1 + args.steps)]
        finally:
            worker.close()
        return {"steps": steps[1:]}
    if args.one == "torch_fused":
        step = _torch_fused(_sizes(args.params, args.bucket))
        return {"steps": [step() for _ in range(1 + args.steps)][1:]}
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        try:
            parallel = "buckets" if args.one == "tier_buckets" else "intra_op"
            backward, step, optimizer = _tier(args.params, args.bucket, args.one == "tier_copies", parallel)
            steps = [(backward(), step())[1] for _ in range(1 + args.steps)]
            return {"steps": steps[1:], "buckets": len(optimizer.buckets)}
        finally:
            dist.destroy_process_group()


def _measure_isolated(args: argparse.Namespace) -> dict[str, Any]:
    """``--isolate``: rounds of children, one per variant and thread count, in an order rotated every round."""
    wanted = [v for v in args.variants.split(",") if v != "deepspeed" or args.deepspeed_python]
    threads = [int(t) for t in args.threads.split(",")]
    names = [f"{name}@{t}" for t in threads for name in wanted]
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu_times: dict[str, list[float]] = {name: [] for name in names}
    buckets = 0
    for round_ in range(args.warmup + args.rounds):
        order = names[round_ % len(names) :] + names[: round_ % len(names)]
        for label in order:
            name, count = label.split("@")
            child = [sys.executable, __file__, "--one", name, "--threads", count, "--steps", str(args.steps)]
            child += ["--params", str(args.params), "--bucket", str(args.bucket)]
            if args.deepspeed_python:
                child += ["--deepspeed-python", args.deepspeed_python]
            done = subprocess.run(child, check=True, capture_output=True, text=True)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            buckets = result.get("buckets", buckets)
            if round_ >= args.warmup:  # the fastest of the variant's timed steps: the least disturbed
                times[label].append(min(wall for wall, _ in result["steps"]))
                cpu_times[label].append(min(cpu for _, cpu in result["steps"]))
    return {
        "params": sum(_sizes(args.params, args.bucket)),
        "buckets": buckets,
        "tensors": _sizes(args.params, args.bucket),
        "threads": threads,
        "times": times,
        "cpu_times": cpu_times,
        "load_average": os.getloadavg(),
        "isolated": True,
    }


def _spread(values: list[float]) -> dict[str, float]:
    q1, _, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
    return {"median": statistics.median(values), "q1": q1, "q3": q3, "min": min(values), "max": max(values)}


def _report(args: argparse.Namespace, results: dict[str, Any]) -> None:
    rows = []
    summary: dict[str, Any] = {}
    for clock in ("times", "cpu_times"):
        times: dict[str, list[float]] = results[clock]
        for label, values in times.items():
            name, count = label.split("@")
            record: dict[str, Any] = {"seconds": _spread(values)}
            for peer in ("torch_fused", "deepspeed"):
                base = times.get(f"{peer}@{count}")
                if base is not None:
                    record[f"ratio_to_{peer}"] = _spread([v / b for v, b in zip(values, base, strict=True)])
            summary.setdefault(label, {})[clock] = record
            ns_per_param = statistics.median(values) / results["params"] * 1e9
            ratios = [record.get(f"ratio_to_{p}") for p in ("torch_fused", "deepspeed")]
            cells = [f"{r['median']:.3f} ({r['q1']:.3f}-{r['q3']:.3f})" if r else "" for r in ratios]
            rows.append(
                f"| {name} | {count} | {'wall' if clock == 'times' else 'CPU'} "
                f"| {statistics.median(values) * 1e3:.1f} | {ns_per_param:.2f} | {cells[0]} | {cells[1]} |"
            )
    print(
        f"AdamW step, {results['params']:,} fp32 parameters ({len(results['tensors'])} tensors) in "
        f"{results['buckets']} buckets, {args.rounds} paired rounds, load average {results['load_average']}"
    )
    print(
        "| variant | threads | clock | median ms/step | ns/param | x torch_fused (quartiles) | x deepspeed (quartiles) |"  # noqa: E501
    )
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {"argv": sys.argv, **results, "summary": summary}
        args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
