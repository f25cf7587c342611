"""ZeRO++ against plain stage 3 through the Trainer: the example GPT on the shipped corpus, 4 ranks as 2 nodes x 2.

    .venv/bin/python benchmarks/zeropp_gpt.py --steps 300 --out benchmarks/results/zeropp_gpt.json

Runs ``tests.zeropp_runs.fit_gpt`` (``GPTConfig.small()`` or ``--model tiny``, ``data/fables.txt``,
``precision="bf16-mixed"``, batch 8 per rank, lr 3e-3, seed 0) twice on 4 gloo processes on this machine,
``ranks_per_node=2``: plain stage 3, then
every ZeRO++ switch on (qwZ int8, hpZ over the 2 ranks of a node, qgZ int4, ``quantization_block`` 2048). Both runs
see the same initial weights and the same batches. Reported per run:

* bytes each rank sent per step, in all and to the other node (``communication_per_step(link=...)``, the median over
  ranks and steps after the first, whose gathers are rounds: Note [data-dependent units]);
* the final loss: the training loss averaged over the last ``--loss-window`` steps and over the ranks (each rank
  sees other batches, so one rank's last loss is noise);
* the median step time (wall, slowest rank), the median CPU time per step and rank (all threads of the rank,
  gloo's included: it barely moves when other processes compete for the cores), the cores other processes used
  during the run (the machine's busy CPU time from ``/proc/stat`` minus the ranks' own, over the run's wall time),
  and the time the inter-node bytes would take at ``--bandwidth-gbit`` Gbit/s, the projection for a real cluster
  (on one machine "inter-node" bytes cross no wire).

``--runs`` picks other runs too (each switch alone), always against plain stage 3.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests import zeropp_runs  # noqa: E402
from tests.harness import run_distributed  # noqa: E402

RUNS: dict[str, dict[str, Any]] = {
    "stage 3": {"ranks_per_node": 2},
    "stage 3 + ZeRO++": {
        "ranks_per_node": 2,
        "quantize_weights": True,
        "hpz_partition_size": 2,
        "quantize_gradients": True,
    },
    "qwZ only": {"ranks_per_node": 2, "quantize_weights": True},
    "hpZ only": {"ranks_per_node": 2, "hpz_partition_size": 2},
    "qgZ only": {"ranks_per_node": 2, "quantize_gradients": True},
}
DEFAULT_RUNS = "stage 3,stage 3 + ZeRO++"


def summarize(ranks: list[dict[str, Any]], loss_window: int, busy: float, wall: float) -> dict[str, Any]:
    """One run's figures from its ranks' records; ``busy``: the machine's busy CPU-seconds over the ``wall`` seconds
    of the run."""
    steps = len(ranks[0]["losses"])
    after_first = range(1, steps)
    sent = {k: statistics.median(r["sent"][s][k] for r in ranks for s in after_first) for k in ("all", "inter_node")}
    final = statistics.fmean(loss for r in ranks for loss in r["losses"][-loss_window:])
    step_time = statistics.median(max(r["seconds"][s] for r in ranks) for s in after_first)
    cpu = statistics.median(r["cpu_seconds"][s] for r in ranks for s in after_first)
    own = sum(sum(r["cpu_seconds"]) for r in ranks)
    return {
        "sent_per_step": sent,
        "final_loss": final,
        "step_time_s": step_time,
        "cpu_per_step_s": cpu,
        "other_cores": max(busy - own, 0.0) / wall,
        "steps": steps,
    }


def busy_cpu_seconds() -> float:
    """CPU-seconds all processes on the machine have spent busy since boot (``/proc/stat``)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--model", choices=["small", "tiny"], default="small")
    parser.add_argument("--loss-window", type=int, default=20)
    parser.add_argument("--bandwidth-gbit", type=float, default=100.0)
    parser.add_argument("--timeout", type=float, default=7200.0)
    parser.add_argument("--runs", default=DEFAULT_RUNS, help=f"comma-separated, of: {', '.join(RUNS)}")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    names = [name.strip() for name in args.runs.split(",")]
    if "stage 3" not in names or not set(names) <= set(RUNS):
        parser.error(f"--runs must include 'stage 3' (the baseline) and name only runs of: {', '.join(RUNS)}")
    results: dict[str, Any] = {}
    raw: dict[str, Any] = {}
    for name in names:
        zero = RUNS[name]
        busy, start = busy_cpu_seconds(), time.perf_counter()
        with tempfile.TemporaryDirectory() as root:
            ranks = run_distributed(
                zeropp_runs.fit_gpt, 4, zero, args.steps, root, args.model, 25,
                init_process_group=False, timeout=args.timeout, collective_timeout=600,
            )  # fmt: skip
        busy, wall = busy_cpu_seconds() - busy, time.perf_counter() - start
        raw[name] = ranks
        results[name] = summarize(ranks, args.loss_window, busy, wall)
        print(name, json.dumps(results[name]), flush=True)
    plain = results["stage 3"]
    seconds_per_byte = 8 / (args.bandwidth_gbit * 1e9)
    print()
    print(
        f"| run | bytes sent / step | to the other node / step | vs stage 3 | at {args.bandwidth_gbit:g} Gbit/s "
        "| final loss | vs stage 3 | step time | CPU / step / rank | other processes |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        inter = r["sent_per_step"]["inter_node"]
        r["inter_node_ratio"] = inter / plain["sent_per_step"]["inter_node"]
        r["final_loss_change"] = r["final_loss"] / plain["final_loss"] - 1
        print(
            f"| {name} | {r['sent_per_step']['all'] / 1e6:.3f} MB | {inter / 1e6:.3f} MB | {r['inter_node_ratio']:.3f} "
            f"| {inter * seconds_per_byte * 1e3:.3f} ms | {r['final_loss']:.4f} | {r['final_loss_change'] * 100:+.2f}% "
            f"| {r['step_time_s'] * 1e3:.0f} ms | {r['cpu_per_step_s'] * 1e3:.0f} ms | {r['other_cores']:.2f} cores |"
        )
    if args.out is not None:
        summary = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": results, "configs": RUNS}
        args.out.write_text(json.dumps({**summary, "per_rank": raw}, indent=1))


if __name__ == "__main__":
    main()
