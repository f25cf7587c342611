"""What Note [one-rank calls] costs: stage-3 forwards without gradients (validation, sampling) and training steps,
with the store rendezvous on and off, in paired interleaved rounds in the same 2 ranks.

    .venv/bin/python benchmarks/one_rank_calls.py --rounds 40 --out benchmarks/results/one_rank_calls.json

Each round times, in a rotated order, one evaluation forward (``torch.no_grad()``, a batch of the benchmark GPT) with
the rendezvous (``gatherer.calls`` attached, as every stage-3 model on several ranks has it) and without it (detached
for that forward), then a training step (forward, backward, step) with and without. A figure is the median over the
rounds of the per-round ratio (slowest rank's time), with a distribution-free 95% interval of that median; the mean
rendezvous time per forward is the median difference. Serving a lone caller is not timed here (it is a test's job);
it costs a store round trip per unit gathered.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import _common as bench
import torch
import torch.distributed as dist

from lightning_zero import ZeroConfig
from lightning_zero.engine.model_sharding import shard_for_stage3
from lightning_zero.engine.optimizer_wrapping import wrap_optimizers
from lightning_zero.models import GPT, GPTConfig
from lightning_zero.trainer.precision import ZeroPrecision


def _timed(fn: Any) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time
    return float(elapsed)


def rank_main(rank: int, world: int, rounds: int) -> dict[str, Any]:
    torch.manual_seed(0)
    config = GPTConfig.tiny(n_layer=8, n_embd=128, n_head=4, vocab_size=256, block_size=64)
    model = GPT(config)
    group = dist.group.WORLD
    assert group is not None
    ranks = SimpleNamespace(process_group=group, root_device=torch.device("cpu"), num_processes=world)
    gatherer = shard_for_stage3(model, ZeroConfig(stage=3), ranks, None, None)
    optimizer = wrap_optimizers(
        model,
        [torch.optim.AdamW(model.parameters(), lr=1e-4)],
        group,
        ZeroConfig(stage=3),
        ZeroPrecision("32-true"),
        gatherer,
        None,
        world,
    )[0]
    calls = gatherer.calls
    tokens = torch.randint(256, (8, 65), generator=torch.Generator().manual_seed(rank))

    def evaluate() -> None:
        with torch.no_grad():
            model(tokens[:, :-1])

    def step() -> None:
        loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    def run(fn: Any, rendezvous: bool) -> float:
        gatherer.calls = calls if rendezvous else None
        try:
            return _timed(fn)
        finally:
            gatherer.calls = calls

    for _ in range(3):  # warm-up: the first step records the order
        run(step, True)
        run(evaluate, True)
    times: dict[str, list[float]] = {k: [] for k in ("eval_on", "eval_off", "step_on", "step_off")}
    for r in range(rounds):
        order = [("eval", True), ("eval", False), ("step", True), ("step", False)]
        order = order[r % 4 :] + order[: r % 4]
        for kind, on in order:
            times[f"{kind}_{'on' if on else 'off'}"].append(run(evaluate if kind == "eval" else step, on))
    return times


def _median_interval(values: list[float]) -> tuple[float, float, float]:
    ordered = sorted(values)
    n = len(ordered)
    half = 1.96 * math.sqrt(n) / 2
    low, high = max(0, int(n / 2 - half)), min(n - 1, math.ceil(n / 2 + half))
    return statistics.median(ordered), ordered[low], ordered[high]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/one_rank_calls.json"))
    ns = parser.parse_args()
    run = bench.run_ranks(rank_main, 2, (ns.rounds,))
    times = run.results[0]
    summary: dict[str, Any] = {"machine": bench.machine_info(), "rounds": ns.rounds}
    for kind in ("eval", "step"):
        ratios = [a / b for a, b in zip(times[f"{kind}_on"], times[f"{kind}_off"], strict=True)]
        extra = [a - b for a, b in zip(times[f"{kind}_on"], times[f"{kind}_off"], strict=True)]
        summary[kind] = {
            "ms_off": 1000 * statistics.median(times[f"{kind}_off"]),
            "ratio_on_off": _median_interval(ratios),
            "extra_ms": [1000 * x for x in _median_interval(extra)],
        }
        median, low, high = summary[kind]["ratio_on_off"]
        print(
            f"{kind}: {summary[kind]['ms_off']:.2f} ms without the rendezvous; with it x{median:.3f} "
            f"[{low:.3f}, {high:.3f}], {summary[kind]['extra_ms'][0]:+.3f} ms"
        )
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
