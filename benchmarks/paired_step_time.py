"""Step-time ratios against DDP measured in pairs: every variant in the same ranks, one step of each in turn.

    .venv/bin/python benchmarks/paired_step_time.py --variants ddp,zero1,zero2,zero3,zero3_root_kept,fsdp2 \\
        --rounds 40 --warmup 3 --out benchmarks/results/paired_step_time.json

``step_time.py`` runs each variant in processes of its own, one after the other, so each variant meets the machine
at a different moment; on a shared 2-core machine the speed drifts by up to 10% between runs, as much as the gaps
being measured. Here every variant is built in the same ranks (same model, seed, optimizer and per-rank batches as
``step_time.py``, built by its runners) and they take their steps in turn: a round is one step of each variant, in
an order rotated every round so that no variant always follows the same one. A variant's ratio to DDP is taken
within each round (the slowest rank's time of each step, from a barrier to the end of the optimizer step) and the
figure is its median over the rounds, with a distribution-free 95% confidence interval of that median: drift slower
than a round cancels out of every ratio. CPU time per step (all threads of a rank) is paired the same way.

Memory is not measured here (every variant lives in the same processes): peak RSS comes from ``step_time.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import _common as bench
import step_time
import torch
import torch.distributed as dist

from lightning_zero.models import GPT, GPTConfig


def paired_rank(rank: int, world: int, variants: list[str], args: step_time.BenchArgs, rounds: int) -> dict[str, Any]:
    """Runs on every rank: build every variant, then ``args.warmup + rounds`` rounds of one step each."""
    config = GPTConfig.bench25m()

    def build() -> GPT:
        torch.manual_seed(args.seed)  # the same initial weights on every rank and in every variant
        return GPT(config)

    device = args.rank_device()
    with device:
        prepared = {v: step_time.RUNNERS[v](build, args) for v in variants}
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)  # the same per-rank data as step_time.py
    tokens = [
        torch.randint(config.vocab_size, (args.batch_size, config.block_size + 1), generator=gen).to(device)
        for _ in range(args.warmup + rounds)
    ]
    times: dict[str, list[float]] = {v: [] for v in variants}
    cpu_times: dict[str, list[float]] = {v: [] for v in variants}
    losses: dict[str, float] = {}
    for r, batch in enumerate(tokens):
        x, y = batch[:, :-1], batch[:, 1:]
        shift = r % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            loss = prepared[variant].step(x, y)
            bench.synchronize(device)
            times[variant].append(time.perf_counter() - start)
            cpu_times[variant].append(time.process_time() - cpu_start)
            losses[variant] = loss.item()
    return {"times": times, "cpu_times": cpu_times, "losses": losses}


def median_interval(values: list[float]) -> tuple[float, float, float]:
    """The median and a distribution-free ~95% confidence interval for it: the order statistics n/2 ± 0.98·√n
    (the binomial(n, 1/2) quantiles, normal approximation)."""
    ordered = sorted(values)
    n = len(ordered)
    half_width = 0.98 * math.sqrt(n)
    low = max(0, math.floor(n / 2 - half_width))
    high = min(n - 1, math.ceil(n / 2 + half_width) - 1)
    return statistics.median(ordered), ordered[low], ordered[high]


def summarize(ranks: list[dict[str, Any]], variants: list[str], warmup: int, baseline: str) -> dict[str, Any]:
    """Per variant: median step time, and its per-round ratio to ``baseline`` (median and interval)."""

    def slowest(key: str, variant: str) -> list[float]:
        steps = len(ranks[0][key][variant])
        return [max(r[key][variant][i] for r in ranks) for i in range(warmup, steps)]

    def cpu(variant: str) -> list[float]:
        return [
            statistics.fmean(r["cpu_times"][variant][i] for r in ranks)
            for i in range(warmup, len(ranks[0]["cpu_times"][variant]))
        ]

    out: dict[str, Any] = {}
    base_wall, base_cpu = slowest("times", baseline), cpu(baseline)
    for variant in variants:
        wall, cpu_per_step = slowest("times", variant), cpu(variant)
        out[variant] = {
            "step_ms": statistics.median(wall) * 1e3,
            "cpu_ms": statistics.median(cpu_per_step) * 1e3,
            "ratio": median_interval([a / b for a, b in zip(wall, base_wall, strict=True)]),
            "cpu_ratio": median_interval([a / b for a, b in zip(cpu_per_step, base_cpu, strict=True)]),
            "last_loss": statistics.fmean(r["losses"][variant] for r in ranks),
            "rounds": len(wall),
        }
    return out


def report(summary: dict[str, Any], baseline: str) -> str:
    header = [
        "variant",
        "step ms (median)",
        f"×{baseline.upper()}, median of per-round ratios",
        "95% CI",
        "CPU ms/step/rank",
        f"CPU ×{baseline.upper()}",
        "95% CI",
        "last-step loss",
    ]
    rows = []
    for variant, s in summary.items():
        ratio, lo, hi = s["ratio"]
        cpu_ratio, cpu_lo, cpu_hi = s["cpu_ratio"]
        rows.append(
            [
                variant,
                f"{s['step_ms']:.0f}",
                f"{ratio:.3f}×",
                f"{lo:.3f}–{hi:.3f}",
                f"{s['cpu_ms']:.0f}",
                f"{cpu_ratio:.3f}×",
                f"{cpu_lo:.3f}–{cpu_hi:.3f}",
                f"{s['last_loss']:.6f}",
            ]
        )
    worst = max(abs(s["last_loss"] - summary[baseline]["last_loss"]) for s in summary.values())
    return (
        bench.markdown_table(header, rows)
        + f"\n\nLoss check: max |loss − {baseline} loss| at the last step = {worst:.2e}."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_device_arguments(parser)
    for f in fields(step_time.BenchArgs):
        if f.name in ("device", "backend", "steps"):
            continue
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds (one step of every variant each)")
    parser.add_argument(
        "--variants", default="ddp,zero1,zero2,zero3,fsdp2", help=f"subset of {list(step_time.RUNNERS)}"
    )
    parser.add_argument("--baseline", default="ddp", help="the variant every ratio is taken against")
    bench.add_mmap_threshold_argument(parser)
    bench.add_contention_arguments(parser)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/paired_step_time.json"))
    ns = parser.parse_args()
    bench.check_device_arguments(parser, ns)
    variants = ns.variants.split(",")
    unknown = sorted(set(variants) - set(step_time.RUNNERS))
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; known: {list(step_time.RUNNERS)}")
    if ns.baseline not in variants:
        parser.error(f"--baseline {ns.baseline!r} must be one of --variants {variants}")
    if ns.rounds < 5:
        parser.error(f"--rounds must be at least 5 for an interval, got {ns.rounds}")
    args = step_time.BenchArgs(
        **{f.name: getattr(ns, f.name) for f in fields(step_time.BenchArgs) if f.name != "steps"}, steps=ns.rounds
    )
    env = {"MALLOC_MMAP_THRESHOLD_": str(ns.mmap_threshold) if ns.mmap_threshold else None}
    run = bench.run_ranks(
        paired_rank,
        args.world_size,
        (variants, args, ns.rounds),
        env,
        ns.idle_wait,
        max_other_cores=ns.max_other_cores,
        attempts=ns.attempts,
        backend=args.backend,
    )
    summary = summarize(run.results, variants, args.warmup, ns.baseline)
    text = report(summary, ns.baseline) + (
        f"\n({ns.rounds} rounds after {args.warmup} of warm-up, {run.wall_s:.0f} s; other processes used "
        f"{run.other_cpu_cores:.2f} cores meanwhile.)"
    )
    print(text)
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "machine": bench.machine_info(),
        "args": asdict(args),
        "variants": variants,
        "baseline": ns.baseline,
        "other_cpu_cores": run.other_cpu_cores,
        "summary": summary,
        "raw": run.results,
        "report_markdown": text,
    }
    ns.out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
