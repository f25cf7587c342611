"""Where a training step's time goes: a copy of ``step_time.py``'s loop with timers around each phase.

    .venv/bin/python benchmarks/profile_step.py --variants ddp,zero1,zero2 --steps 8 --warmup 3 \\
        --out benchmarks/results/profile_step.json

Same model, data, ranks and environment as ``step_time.py``. Phases (ms, median over the timed steps, mean over
ranks): ``zero_grad``, ``forward`` (logits + loss), ``backward`` (DDP: including its overlapped all-reduce and the final
wait for it), ``reduce_finish`` (ours: launching the buckets the hooks did not and waiting for all of them),
``optimizer`` (AdamW itself: full model for DDP, this rank's shard for ours), ``all_gather`` (ours: gathering the
updated parameters). For our stages the reducer's methods are also wrapped (without changing them) to split the time
spent inside backward hooks: storing gradients into buckets (stage 2: staging allocation + copy), launching a bucket
(pre-division, receive-buffer allocation, issuing the all-to-all) and blocking on an in-flight bucket (wait +
local sum), each attributed to the phase in which it happened.

Extra knobs, to test hypotheses: ``--mmap-threshold 0`` (glibc's default malloc behaviour), ``--bucket-numel``,
``--max-inflight-buckets``, ``--no-overlap``.
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

from lightning_zero import ZeroConfig, ZeroOptimizer
from lightning_zero.models import GPT, GPTConfig


class PhaseTimer:
    """Accumulates seconds per phase for the current step; wrapped methods are charged to ``phase/method``."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.phase = "idle"

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        self.phase = phase
        start = time.perf_counter()
        try:
            yield
        finally:
            self.current[phase] += time.perf_counter() - start
            self.phase = "idle"

    def wrap(self, obj: object, method: str) -> None:
        original = getattr(obj, method)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.current[f"  {self.phase}/{method}"] += time.perf_counter() - start

        setattr(obj, method, timed)

    def take(self) -> dict[str, float]:
        step, self.current = dict(self.current), defaultdict(float)
        return step


def profile_rank(rank: int, world: int, variant: str, args: BenchArgs, zero: dict[str, Any]) -> list[dict[str, float]]:
    config = GPTConfig.bench25m()
    torch.manual_seed(args.seed)
    model = GPT(config)
    timer = PhaseTimer()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if variant == "ddp":
        forward: Callable[[torch.Tensor], torch.Tensor] = DistributedDataParallel(model)
        zopt = None
    else:
        zopt = ZeroOptimizer(model, opt, dist.group.WORLD, ZeroConfig(stage=int(variant[-1]), **zero))
        forward = model
        for method in ("_store", "_launch", "_wait_oldest"):
            timer.wrap(zopt.reducer, method)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    steps = []
    for _ in range(args.warmup + args.steps):
        batch = torch.randint(config.vocab_size, (args.batch_size, config.block_size + 1), generator=gen)
        x, y = batch[:, :-1], batch[:, 1:]
        dist.barrier()
        start = time.perf_counter()
        with timer("zero_grad"):
            (zopt or opt).zero_grad()
        with timer("forward"):
            loss = lm_loss(forward(x), y)
        with timer("backward"):
            loss.backward()
        if zopt is None:
            with timer("optimizer"):
                opt.step()
        else:
            with torch.no_grad():  # ZeroOptimizer.step(), phase by phase
                with timer("reduce_finish"):
                    zopt.reduce_gradients()
                with timer("optimizer"):
                    zopt.optimizer.step()
                with timer("all_gather"):
                    zopt._gather_parameters()
                for bucket, master in zip(zopt.buckets, zopt.masters, strict=True):
                    if master.grad is not zopt.reducer.grad_shard(bucket):
                        master.grad = None
                zopt.ledger.end_step()
        total = time.perf_counter() - start
        steps.append({**timer.take(), "total": total})
    return steps[args.warmup :]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="ddp,zero1,zero2")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--mmap-threshold", type=int, default=65536, help="0: glibc's default")
    parser.add_argument("--bucket-numel", type=int, default=None)
    parser.add_argument("--max-inflight-buckets", type=int, default=None)
    parser.add_argument("--no-overlap", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/profile_step.json"))
    ns = parser.parse_args()
    args = BenchArgs(world_size=ns.world_size, steps=ns.steps, warmup=ns.warmup)
    zero: dict[str, Any] = {"overlap_comm": not ns.no_overlap}
    if ns.bucket_numel:
        zero["bucket_numel"] = ns.bucket_numel
    if ns.max_inflight_buckets:
        zero["max_inflight_buckets"] = ns.max_inflight_buckets
    env = {"MALLOC_MMAP_THRESHOLD_": str(ns.mmap_threshold) if ns.mmap_threshold else None}
    variants = ns.variants.split(",")
    medians: dict[str, dict[str, float]] = {}
    raw: dict[str, Any] = {}
    for variant in variants:
        ranks = bench.run_ranks(profile_rank, ns.world_size, (variant, args, zero), env)
        raw[variant] = ranks
        phases = sorted({k for r in ranks for s in r for k in s}, key=lambda k: (k == "total", k.strip()))
        medians[variant] = {
            k: statistics.fmean(statistics.median(s.get(k, 0.0) for s in r) for r in ranks) for k in phases
        }
    phases = list(dict.fromkeys(k for m in medians.values() for k in m))
    phases.sort(key=lambda k: (k == "total", _ORDER.get(k.strip().split("/")[0], 9), k.strip()))
    rows = [[k] + [f"{medians[v][k] * 1e3:.1f}" if k in medians[v] else "" for v in variants] for k in phases]
    text = bench.markdown_table(["ms (median over steps, mean over ranks)", *variants], rows)
    text += f"\n\nZeroConfig overrides: {zero}; MALLOC_MMAP_THRESHOLD_={env['MALLOC_MMAP_THRESHOLD_']}"
    print(text)
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"machine": bench.machine_info(), "zero": zero, "env": env, "medians_s": medians, "raw": raw}
    ns.out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {ns.out}")


_ORDER = {"zero_grad": 0, "forward": 1, "backward": 2, "reduce_finish": 3, "optimizer": 4, "all_gather": 5}

if __name__ == "__main__":
    main()
