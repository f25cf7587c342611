"""Where the training thread's time goes in a host-tier step on the copy path, per bucket, and the step's wall time,
for one or more source trees paired in one run.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/host_path.py --params 60000000 --bucket 4000000 --threads 1,2 \\
        --rounds 6 --trees old=/path/to/other/tree,new=$PWD --out benchmarks/results/host_path.json

The model: square bf16 ``Linear`` layers without bias, four to a bucket (widths a multiple of 64), bf16-mixed
(bf16 parameters, fp32 masters), ``ZeroOptimizer`` at stage 2 on one rank with ``offload_optimizer="cpu"``, on
the host tier's copy path (``host_copies.FORCE_COPIES``: what a GPU runs, with the CPU doing the copies), clipped
by norm (``--clip``) before each step, AdamW. Each tree (``--trees name=path``) runs in a process of its own
(``PYTHONPATH=path``), and a round steps each of them ``--steps`` times at each of ``--threads``, in an order
rotated every round: paired, interleaved rounds, so the drift of a shared machine cancels in the ratios.

Per step, the training thread's time is split by wrapping the tier's functions (exclusive times, thread CPU clock
``time.thread_time`` and wall clock): ``download`` (the gradient's copy to the host buffer, in the backward
or the step), ``gradients`` (``TieredGradients.set_on_masters``: conversion to fp32, unscaling, clipping, or
just their setup where the worker does them), ``norm`` (the clipping norm's pass over the gradients: the host
copies, or, from 2026-11-28, the device shards, device work on a GPU),
``wait`` (``HostSteps.finish``/``join``: waiting for the worker's updates), ``round`` (``HostTier.write_back``
without the upload: the rounding of the masters into the staging buffer, where the training thread does it),
``upload`` (the copy of the rounded values into the parameter shard), ``edits`` (the edit check: the digests of
Note [edits reach the masters], which on a GPU run on the device: a CPU-only cost, reported apart and left out of
``thread_ex_edits``), and ``other``: the rest of the step (Python per bucket, the all-gather call, the moments'
step counts). ``thread_ex_device`` leaves out ``norm`` too; ``step_wall`` is the wall time from the clipping to
the end of the step, ``wall_ex_edits`` and ``wall_ex_device`` less those parts' wall time. ``worker_cpu`` is the
worker threads' CPU time in their bucket tasks. Each round keeps each tree's fastest step (by ``thread_ex_edits``:
the least disturbed); the table shows medians over the rounds and each tree's ratio to the first tree's in the same
round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_CATEGORIES = {
    "download": [("lightning_zero.offload.host_tier", "HostTier", "_download")],
    "gradients": [("lightning_zero.offload.tiered_gradients", "TieredGradients", "set_on_masters")],
    "norm": [("lightning_zero.offload.tiered_gradients", "TieredGradients", "norms")],
    "wait": [
        ("lightning_zero.offload.host_steps", "HostSteps", "finish"),
        ("lightning_zero.offload.host_steps", "HostSteps", "join"),
    ],
    "round": [("lightning_zero.offload.host_tier", "HostTier", "write_back")],
    "upload": [("lightning_zero.offload.host_tier", "HostTier", "_write_shard")],
    "edits": [
        ("lightning_zero.sharding.param_edits", "ParamEdits", "check"),
        ("lightning_zero.sharding.param_edits", "ParamEdits", "record"),
        ("lightning_zero.offload.host_tier", "HostTier", "adopt_edits"),
    ],
}


class _Clock:
    """Exclusive thread-CPU and wall seconds per category on the training thread (nested calls subtracted)."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.cpu: dict[str, float] = {}
        self.wall: dict[str, float] = {}
        self.worker_cpu = 0.0
        self._stack: list[list[float]] = []
        self._lock = threading.Lock()

    def reset(self) -> None:
        self.cpu = dict.fromkeys(_CATEGORIES, 0.0)
        self.wall = dict.fromkeys(_CATEGORIES, 0.0)
        self.worker_cpu = 0.0

    def wrap(self, category: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != self.thread:
                return function(*args, **kwargs)
            frame = [time.thread_time(), time.perf_counter(), 0.0, 0.0]
            self._stack.append(frame)
            try:
                return function(*args, **kwargs)
            finally:
                self._stack.pop()
                cpu, wall = time.thread_time() - frame[0], time.perf_counter() - frame[1]
                self.cpu[category] += cpu - frame[2]
                self.wall[category] += wall - frame[3]
                if self._stack:
                    self._stack[-1][2] += cpu
                    self._stack[-1][3] += wall

        return timed

    def wrap_worker(self, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                with self._lock:
                    self.worker_cpu += time.thread_time() - start

        return timed


def _child(args: argparse.Namespace) -> None:
    """One tree's process: builds the model, then steps when told to (``step THREADS``), one JSON line per step."""
    import importlib

    import torch
    import torch.distributed as dist
    from torch import nn

    from lightning_zero import ZeroConfig, ZeroOptimizer
    from lightning_zero.offload import host_copies
    from lightning_zero.offload.host_steps import HostSteps
    from lightning_zero.offload.memory_tiers import MemoryTiers

    clock = _Clock()
    for category, places in _CATEGORIES.items():
        for module, cls, name in places:
            owner = getattr(importlib.import_module(module), cls)
            setattr(owner, name, clock.wrap(category, getattr(owner, name)))
    HostSteps._timed = clock.wrap_worker(HostSteps._timed)  # type: ignore[method-assign]
    clock.reset()

    tmp = tempfile.mkdtemp()
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
    torch.manual_seed(0)
    width = int((args.bucket // 4) ** 0.5) // 64 * 64
    count = max(1, round(args.params / (width * width)))
    model = nn.Sequential(*[nn.Linear(width, width, bias=False, dtype=torch.bfloat16) for _ in range(count)])
    config = ZeroConfig(stage=2, offload_optimizer="cpu", bucket_numel=args.bucket)
    host_copies.FORCE_COPIES = True  # the copy path: what a GPU runs (Note [host tier data path])
    tiers = MemoryTiers(config, None, io_entries=2)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    optimizer = ZeroOptimizer(model, adamw, dist.group.WORLD, config, tiers=tiers.for_optimizer())
    batch = torch.randn(2, width, dtype=torch.bfloat16)
    print(json.dumps({"params": sum(p.numel() for p in model.parameters()), "buckets": len(optimizer.buckets)}))
    sys.stdout.flush()
    for line in sys.stdin:
        threads = int(line.split()[1])
        torch.set_num_threads(threads)
        for host_steps in tiers.host_steps:  # the worker takes the caller's thread count at its start
            if host_steps.threads != threads:
                host_steps.close()
                host_steps.threads = threads
        clock.reset()
        optimizer.zero_grad()
        start_cpu, start = time.thread_time(), time.perf_counter()
        model(batch).float().square().mean().backward()
        backward_cpu, backward = time.thread_time() - start_cpu, time.perf_counter() - start
        downloaded = clock.cpu["download"]  # in the backward, as each bucket's reduction completes
        if args.clip:
            optimizer.clip_grad_norm_(1.0)
        optimizer.step()
        step_cpu, step = time.thread_time() - start_cpu - backward_cpu, time.perf_counter() - start - backward
        parts = {f"{k}_cpu": v for k, v in clock.cpu.items()} | {f"{k}_wall": v for k, v in clock.wall.items()}
        inside = sum(clock.cpu.values())
        record = {
            "backward_cpu": backward_cpu,
            "backward_wall": backward,
            "step_wall": step,
            "thread_cpu": step_cpu + downloaded,  # the step's, and the downloads in the backward
            "worker_cpu": clock.worker_cpu,
            **parts,
        }
        record["thread_ex_edits"] = record["thread_cpu"] - clock.cpu["edits"]
        record["thread_ex_device"] = record["thread_ex_edits"] - clock.cpu["norm"]
        record["wall_ex_edits"] = step - clock.wall["edits"]
        record["wall_ex_device"] = record["wall_ex_edits"] - clock.wall["norm"]
        record["other_cpu"] = record["thread_cpu"] - inside
        print(json.dumps(record))
        sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=60_000_000)
    parser.add_argument("--bucket", type=int, default=4_000_000)
    parser.add_argument("--threads", default="1", help="comma-separated intra-op thread counts, e.g. 1,2")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2, help="steps of each tree per round (the fastest counts)")
    parser.add_argument("--clip", type=int, default=1, help="clip by norm before each step (1) or not (0)")
    parser.add_argument("--trees", default=f"this={Path(__file__).resolve().parents[1]}", help="name=path,...")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return
    trees = dict(item.split("=", 1) for item in args.trees.split(","))
    uptime_before = os.getloadavg()
    children: dict[str, subprocess.Popen[str]] = {}
    info: dict[str, Any] = {}
    argv = [
        sys.argv[0],
        "--child",
        "--params",
        str(args.params),
        "--bucket",
        str(args.bucket),
        "--clip",
        str(args.clip),
    ]
    for name, path in trees.items():
        env = {**os.environ, "PYTHONPATH": path}
        children[name] = subprocess.Popen(
            [sys.executable, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        assert children[name].stdout is not None
        info[name] = json.loads(children[name].stdout.readline())
    threads = [int(t) for t in args.threads.split(",")]
    labels = [f"{name}@{t}" for t in threads for name in trees]
    kept: dict[str, list[dict[str, float]]] = {label: [] for label in labels}
    try:
        for round_ in range(args.warmup + args.rounds):
            order = labels[round_ % len(labels) :] + labels[: round_ % len(labels)]
            found = {}
            for label in order:
                name, count = label.split("@")
                child = children[name]
                assert child.stdin is not None
                assert child.stdout is not None
                steps = []
                for _ in range(args.steps):
                    child.stdin.write(f"step {count}\n")
                    child.stdin.flush()
                    steps.append(json.loads(child.stdout.readline()))
                found[label] = min(steps, key=lambda s: s["thread_ex_edits"])
            if round_ >= args.warmup:
                for label in labels:
                    kept[label].append(found[label])
    finally:
        for child in children.values():
            assert child.stdin is not None
            child.stdin.close()
            child.wait(timeout=120)
    _report(args, trees, threads, kept, info, uptime_before)


def _report(
    args: argparse.Namespace,
    trees: dict[str, str],
    threads: list[int],
    kept: dict[str, list[dict[str, float]]],
    info: dict[str, Any],
    uptime_before: tuple[float, float, float],
) -> None:
    first = next(iter(trees))
    buckets = info[first]["buckets"]
    print(
        f"{info[first]['params']:,} bf16 parameters in {buckets} buckets, {args.rounds} paired rounds, "
        f"load average {uptime_before} before, {os.getloadavg()} after; ms per step (median over rounds)"
    )
    columns = ["download", "gradients", "norm", "wait", "round", "upload", "other", "edits"]
    totals = ["thread_ex_edits", "thread_ex_device", "step_wall", "wall_ex_edits", "wall_ex_device"]
    print(
        "| tree | threads | "
        + " | ".join(f"{t} | x first" for t in totals)
        + " | worker CPU | "
        + " | ".join(columns)
        + " |"
    )
    print("|---" * (3 + 2 * len(totals) + len(columns)) + "|")
    summary: dict[str, Any] = {}
    for label, records in kept.items():
        name, count = label.split("@")
        base = kept[f"{first}@{count}"]

        def median(key: str, rows: list[dict[str, float]] = records) -> float:
            return statistics.median(r[key] for r in rows) * 1e3

        def ratio(key: str, rows: list[dict[str, float]] = records, base: list[dict[str, float]] = base) -> float:
            return statistics.median(r[key] / b[key] for r, b in zip(rows, base, strict=True))

        cells = [f"{median(f'{c}_cpu'):.1f}" for c in columns]
        pairs = " | ".join(f"{median(t):.1f} | {ratio(t):.3f}" for t in totals)
        print(f"| {name} | {count} | {pairs} | {median('worker_cpu'):.1f} | " + " | ".join(cells) + " |")
        summary[label] = {key: median(key) for key in records[0]} | {f"{t}_ratio": ratio(t) for t in totals}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {"argv": sys.argv, "trees": trees, "info": info, "rounds": kept, "summary": summary}
        args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
