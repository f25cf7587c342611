"""Where a training step's time goes: ``step_time.py``'s loop with timers around each phase.

    .venv/bin/python benchmarks/profile_step.py --variants ddp,zero1,zero2 --steps 8 --warmup 3 \\
        --out benchmarks/results/profile_step.json

Same model, data, ranks and environment as ``step_time.py``. Phases (ms, median over the timed steps, mean over
ranks): ``zero_grad``, ``forward`` (logits + loss), ``backward`` (DDP: including its overlapped all-reduce and the final
wait for it) and the optimizer ``step``. For our stages some methods are wrapped on the instances (their code is not
changed) to split the time further, each charged to the phase in which it ran: ``ZeroOptimizer.reduce_gradients``
(launch what the backward hooks did not, wait for every bucket), the wrapped ``AdamW.step`` (this rank's shard; for
DDP the whole ``step`` is AdamW on the full model), ``ZeroOptimizer.gather_parameters`` (all-gather of the updated
parameters) and, inside backward, the reducer's ``_store`` (stage 2: copy into the bucket's staging buffer),
``_launch`` (issuing the all-to-all) and ``_wait_oldest`` (blocking on an
in-flight bucket, then the local sum). Rows marked ``[cpu]`` are the CPU time of the rank's
main thread in that phase (``time.thread_time``): nearly blind to other processes competing for the cores, and ~0 while
blocked on communication; ``total [cpu, all threads]`` includes gloo's threads.

Extra knobs, to test hypotheses: ``--mmap-threshold 0`` (glibc's default malloc behaviour), ``--bucket-numel``,
``--max-inflight-buckets`` and ``--no-overlap``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import _common as bench
import torch
import torch.distributed as dist
from step_time import BenchArgs, lm_loss
from torch.nn.parallel import DistributedDataParallel

from lightning_zero import ZeroConfig, ZeroOptimizer, shard_module
from lightning_zero.models import GPT, GPTConfig


class PhaseTimer:
    """Accumulates, per phase of the current step, wall seconds and this thread's CPU seconds (``phase [cpu]``: less
    sensitive to other processes competing for the cores). Wrapped methods are charged to ``phase/method``."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.phase = "idle"

    def _charge(self, key: str, wall: float, cpu: float) -> None:
        self.current[key] += time.perf_counter() - wall
        self.current[f"{key} [cpu]"] += time.thread_time() - cpu

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        self.phase = phase
        self.current[f"{phase} RSS at start MiB"] = _rss_mib("VmRSS")
        _reset_peak_rss()
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self._charge(phase, wall, cpu)
            self.current[f"{phase} peak RSS MiB"] = _rss_mib("VmHWM")
            self.phase = "idle"

    def wrap(self, obj: object, method: str, label: str | None = None) -> None:
        original = getattr(obj, method)

        def timed(*args: Any, **kwargs: Any) -> Any:
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                self._charge(f"  {self.phase}/{label or method}", wall, cpu)

        setattr(obj, method, timed)

    def take(self) -> dict[str, float]:
        step, self.current = dict(self.current), defaultdict(float)
        return step


def _reset_peak_rss() -> None:
    """Start a new peak-RSS window: ``VmHWM`` restarts from the current RSS (Linux ``clear_refs`` value 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _rss_mib(key: str) -> float:
    """``VmRSS`` or ``VmHWM`` in MiB. Phase rows ``... MiB`` are memory, not milliseconds."""
    return bench.memory_status()[key] / 2**20


def profile_rank(rank: int, world: int, variant: str, args: BenchArgs, zero: dict[str, Any]) -> list[dict[str, float]]:
    config = GPTConfig.bench25m()
    torch.manual_seed(args.seed)
    device = args.rank_device()
    torch.set_default_device(device)  # every model and buffer below lives on this rank's device
    model = GPT(config)
    timer = PhaseTimer()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    forward: Callable[[torch.Tensor], torch.Tensor] = model
    step_opt: torch.optim.Optimizer = opt
    if variant == "ddp":
        forward = DistributedDataParallel(model)
    elif variant == "fsdp2":  # as step_time.py: one unit per block plus the root
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(args.device, (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = step_opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    else:
        stage = int(variant[-1])
        gatherer = None
        if stage == 3:  # as step_time.py: built on meta and sharded, one unit per block plus the root
            torch.manual_seed(args.seed)  # the same initial weights as the other variants
            with torch.device("meta"):
                model = GPT(config)
            gatherer = shard_module(model, ZeroConfig(stage=3, **zero), dist.group.WORLD, device)
            opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
            forward = model
            for unit in gatherer.units:
                for method in ("gather", "wait"):
                    timer.wrap(unit, method, f"unit.{method}")
        zopt = ZeroOptimizer(model, opt, dist.group.WORLD, ZeroConfig(stage=stage, **zero), gatherer)
        for obj, method in [(zopt, "reduce_gradients"), (opt, "step"), (zopt, "gather_parameters")]:
            timer.wrap(obj, method)
        for method in ("_store", "_launch", "_wait_oldest"):
            timer.wrap(zopt.reducer, method)
        step_opt = zopt
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    steps = []
    for _ in range(args.warmup + args.steps):
        batch = torch.randint(config.vocab_size, (args.batch_size, config.block_size + 1), generator=gen, device="cpu")
        batch = batch.to(device)
        x, y = batch[:, :-1], batch[:, 1:]
        dist.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        with timer("zero_grad"):
            step_opt.zero_grad()
        with timer("forward"):
            loss = lm_loss(forward(x), y)
        with timer("backward"):
            loss.backward()
        with timer("step"):
            step_opt.step()
            bench.synchronize(device)  # on a GPU the phases above time the launches; the total is the step
        total = time.perf_counter() - start
        cpu = time.process_time() - cpu_start
        steps.append({**timer.take(), "total": total, "total [cpu, all threads]": cpu, "loss": loss.item()})
    return steps[args.warmup :]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="ddp,zero1,zero2")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=2)
    bench.add_device_arguments(parser)
    bench.add_mmap_threshold_argument(parser)
    parser.add_argument("--bucket-numel", type=int, default=None)
    parser.add_argument("--max-inflight-buckets", type=int, default=None)
    parser.add_argument("--no-overlap", action="store_true")
    parser.add_argument("--no-divergence-check", action="store_true", help="stage 3: check_rank_divergence=False")
    parser.add_argument(
        "--zero-option",
        action="append",
        default=[],
        metavar="FIELD=JSON",
        help="any other ZeroConfig field for our stages, e.g. reshard_root_after_forward=false (repeatable)",
    )
    bench.add_contention_arguments(parser)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/profile_step.json"))
    ns = parser.parse_args()
    bench.check_device_arguments(parser, ns)
    args = BenchArgs(world_size=ns.world_size, steps=ns.steps, warmup=ns.warmup, device=ns.device, backend=ns.backend)
    zero: dict[str, Any] = {"overlap_comm": not ns.no_overlap}
    if ns.no_divergence_check:
        zero["check_rank_divergence"] = False
    if ns.bucket_numel:
        zero["bucket_numel"] = ns.bucket_numel
    if ns.max_inflight_buckets:
        zero["max_inflight_buckets"] = ns.max_inflight_buckets
    for option in ns.zero_option:
        field, _, value = option.partition("=")
        zero[field] = json.loads(value)
    env = {"MALLOC_MMAP_THRESHOLD_": str(ns.mmap_threshold) if ns.mmap_threshold else None}
    variants = ns.variants.split(",")
    medians: dict[str, dict[str, float]] = {}
    losses: dict[str, float] = {}
    raw: dict[str, Any] = {}
    for variant in variants:
        run = bench.run_ranks(
            profile_rank,
            ns.world_size,
            (variant, args, zero),
            env,
            ns.idle_wait,
            max_other_cores=ns.max_other_cores,
            attempts=ns.attempts,
            backend=ns.backend,
        )
        ranks = run.results
        print(f"{variant}: other processes used {run.other_cpu_cores:.2f} cores meanwhile", flush=True)
        raw[variant] = ranks
        phases = {k for r in ranks for s in r for k in s} - {"loss"}
        losses[variant] = statistics.fmean(r[-1]["loss"] for r in ranks)
        medians[variant] = {
            k: statistics.fmean(statistics.median(s.get(k, 0.0) for s in r) for r in ranks) for k in phases
        }
    phases = list(dict.fromkeys(k for m in medians.values() for k in m))
    phases.sort(key=lambda k: (k.startswith("total"), _ORDER.get(k.strip().split("/")[0].split()[0], 9), k.strip()))

    def cell(v: str, k: str) -> str:
        if k not in medians[v]:
            return ""
        return f"{medians[v][k]:.0f}" if k.endswith("MiB") else f"{medians[v][k] * 1e3:.1f}"  # memory rows, ms rows

    rows = [[k] + [cell(v, k) for v in variants] for k in phases]
    rows.append(["loss at the last step (mean over ranks)"] + [f"{losses[v]:.6f}" for v in variants])
    text = bench.markdown_table(["ms (median over steps, mean over ranks)", *variants], rows)
    text += f"\n\nZeroConfig overrides: {zero}; MALLOC_MMAP_THRESHOLD_={env['MALLOC_MMAP_THRESHOLD_']}"
    print(text)
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"machine": bench.machine_info(), "zero": zero, "env": env}
    payload |= {"medians_s": medians, "raw": raw}
    ns.out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {ns.out}")


_ORDER = {"zero_grad": 0, "forward": 1, "backward": 2, "step": 3}

if __name__ == "__main__":
    main()
