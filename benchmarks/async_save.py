"""What a sharded save every 10 steps costs the training, synchronous against ``ZeroConfig.async_save``, through the
Trainer: a GPT (``--model small``: 3.3M parameters; ``bench25m``: 25M) in fp32 with AdamW at stage 2 on 2 CPU ranks,
``--batch`` x 128 tokens per rank.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/async_save.py [--model small] [--batch 2] [--cycles 6]

Paired and interleaved within one fit, so that the machine's drift cancels: after 10 warm-up steps, every 10th step
ends with no save, a synchronous save or an asynchronous one, in turn (``cycles`` times, and a last segment without
a save). Each save goes through ``trainer.save_checkpoint`` (what ``ModelCheckpoint`` calls), with the strategy's
``config.async_save`` set for that save, and the previous checkpoint of the same kind is removed as
``ModelCheckpoint(save_top_k=1)`` would. The cost of a save is the time of the 10 steps it starts (its own time on
the training thread included, and the background writer's competition for the CPU and the GIL) over that of the
segments without a save on either side of its cycle, minus 1; the same estimator for the segment without a save
against its neighbours is the noise floor. The same again on the training thread's time not spent queued for a CPU
(Linux ``schedstat``), which takes out most of what other people's processes add on shared cores.

Also measured, per save: the training thread's time inside ``save_checkpoint``; the writer thread's wall and CPU
time; the extra CPU time of the rank's processes, the training process and its writer process (what a save takes
from a machine whose cores are all busy); and the wake-up latency of a probe thread sleeping 1 ms at a time (it
rises when another thread holds the GIL, or when the cores are busy). Prints tables and writes
``results/async_save.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

from lightning_zero import ZeroStrategy  # noqa: E402
from lightning_zero.checkpoint.async_save import AsyncSaver  # noqa: E402
from lightning_zero.models import GPTConfig, LitGPT, SyntheticTextDataModule  # noqa: E402
from tests.harness import run_distributed  # noqa: E402

EVERY = 10
MODES = ("none", "sync", "async")


class Probe:
    """A thread that sleeps 1 ms at a time and records how late it wakes (it needs the GIL to wake)."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.perf_counter()
            time.sleep(0.001)
            self.samples.append((start, time.perf_counter() - start - 0.001))

    def __enter__(self) -> Probe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def children_cpu() -> float:
    """CPU seconds of this process's running children (the writer process), from ``/proc``."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid():
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def not_queued() -> float:
    """Seconds of this thread's life so far not spent waiting in a run queue for a CPU (``schedstat``'s second
    field): the wall clock minus what other processes on busy cores take from it; waits for the GIL, for I/O and for
    the other rank remain."""
    with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as stat:
        queued = int(stat.read().split()[1])
    return time.perf_counter() - queued / 1e9


class Saves(pl.Callback):
    """Records each step's end (wall clock; CPU time of the process and, every ``EVERY`` steps, of its children) and
    every ``EVERY`` steps saves in the cycle's mode."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.ends: list[float] = []
        self.unqueued: list[float] = []
        self.cpu: list[float] = []
        self.saves: list[dict[str, Any]] = []
        self._previous: dict[str, str] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.ends.append(time.perf_counter())
        self.unqueued.append(not_queued())
        step = len(self.ends)
        self.cpu.append(time.process_time() + (0.0 if step % EVERY else children_cpu()))
        if step % EVERY or step == trainer.max_steps:
            return
        mode = MODES[(step // EVERY - 1) % len(MODES)]
        if mode == "none":
            return
        strategy = trainer.strategy
        assert isinstance(strategy, ZeroStrategy)
        config = strategy.config
        strategy.config = dataclasses.replace(config, async_save=mode == "async")
        path = f"{self.root}/{mode}-{step}.ckpt"
        start, cpu = time.perf_counter(), time.thread_time()
        trainer.save_checkpoint(path)
        self.saves.append(
            {
                "step": step,
                "mode": mode,
                "thread_s": time.perf_counter() - start,
                "thread_cpu_s": time.thread_time() - cpu,
            }
        )
        strategy.config = config
        if mode in self._previous:
            strategy.remove_checkpoint(self._previous[mode])
        self._previous[mode] = path


def _fit(root: str, model: str, batch: int, cycles: int) -> dict[str, Any]:
    config = getattr(GPTConfig, model)()
    saves = Saves(root)
    writes: list[dict[str, float]] = []
    write = AsyncSaver._write

    def timed_write(self: AsyncSaver, *args: Any) -> None:  # instrumentation: the writer thread's wall and CPU time
        start, cpu = time.perf_counter(), time.thread_time()
        write(self, *args)
        writes.append({"start": start, "wall_s": time.perf_counter() - start, "cpu_s": time.thread_time() - cpu})

    AsyncSaver._write = timed_write  # type: ignore[method-assign]
    steps = EVERY * (len(MODES) * cycles + 2)
    torch.manual_seed(0)
    trainer = pl.Trainer(
        strategy=ZeroStrategy(stage=2, async_save=True),
        accelerator="cpu",
        devices=2,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[saves],
        limit_val_batches=0,
    )
    data = SyntheticTextDataModule(
        vocab_size=config.vocab_size, seq_len=128, batch_size=batch, num_train=2 * batch * steps
    )
    with Probe() as probe:
        trainer.fit(LitGPT(config), data)
    AsyncSaver._write = write  # type: ignore[method-assign]
    return {
        "ends": saves.ends,
        "unqueued": saves.unqueued,
        "cpu": saves.cpu,
        "saves": saves.saves,
        "writes": writes,
        "probe": probe.samples,
    }


def segments(values: list[float]) -> list[float]:
    """The span of each 10-step segment after the warm-up: from the end of step 10k to the end of step 10(k+1)."""
    return [values[k + EVERY - 1] - values[k - 1] for k in range(EVERY, len(values) - EVERY + 1, EVERY)]


def costs(spans: list[float], relative: bool = True) -> dict[str, list[float]]:
    """Each save's cost: its segment over (``relative``; else minus) the mean of the no-save segments that open this
    cycle and the next, - 1; for ``none``, the middle no-save segment against its two neighbours (the noise floor)."""
    out: dict[str, list[float]] = {mode: [] for mode in MODES}
    n = len(MODES)

    def cost(span: float, base: float) -> float:
        return span / base - 1 if relative else span - base

    for c in range(0, len(spans) - n, n):
        base = (spans[c] + spans[c + n]) / 2
        for i, mode in enumerate(MODES[1:], 1):
            out[mode].append(cost(spans[c + i], base))
        if c + 2 * n < len(spans):
            out["none"].append(cost(spans[c + n], (spans[c] + spans[c + 2 * n]) / 2))
    return out


def _percent(values: list[float]) -> str:
    return ", ".join(f"{100 * v:+.1f}%" for v in values)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="small", choices=["small", "bench25m"])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--cycles", type=int, default=6)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    uptime = ["uptime"]
    load = subprocess.run(uptime, capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(
            _fit, 2, root, args.model, args.batch, args.cycles, init_process_group=False, timeout=3000
        )
    load_after = subprocess.run(uptime, capture_output=True, text=True).stdout.strip()
    run = results[0]  # rank 0's clocks; the ranks step in lockstep
    spans = segments(run["ends"])
    cost = costs(spans)
    unqueued = costs(segments(run["unqueued"]))
    cpu = costs(segments(run["cpu"]), relative=False)
    step = statistics.median(spans[:: len(MODES)]) / EVERY
    print(f"{args.model}, batch {args.batch} x 128 per rank, 2 ranks: median step {step:.3f} s without saves")
    print("| save | cost per save / 10 steps (each cycle) | median | on the training thread | writer wall, CPU |")
    print("|---|---|---|---|---|")
    for mode in MODES:
        saves = [s for s in run["saves"] if s["mode"] == mode]
        thread = statistics.median(s["thread_s"] for s in saves) if saves else 0.0
        own = f"{1e3 * thread:.0f} ms ({100 * thread / (EVERY * step):.1f}%)" if saves else "-"
        writer = "-"
        if mode == "async":
            wall = statistics.median(w["wall_s"] for w in run["writes"])
            busy = statistics.median(w["cpu_s"] for w in run["writes"])
            writer = f"{1e3 * wall:.0f} ms, {1e3 * busy:.0f} ms"
        label = "none (noise floor)" if mode == "none" else mode
        print(f"| {label} | {_percent(cost[mode])} | {100 * statistics.median(cost[mode]):+.1f}% | {own} | {writer} |")
    print("\nThe same, counting only the training thread's time not queued for a CPU:")
    for mode in MODES:
        print(f"| {mode} | {_percent(unqueued[mode])} | {100 * statistics.median(unqueued[mode]):+.1f}% |")
    for mode in MODES:
        extra = statistics.median(cpu[mode])
        print(f"CPU time (rank 0 and its writer process) of the 10 steps after a {mode} save, over no save's: ", end="")
        print(f"{extra:+.3f} s")
    during: list[float] = []
    outside: list[float] = []
    for t, lat in run["probe"]:
        if t > run["ends"][EVERY - 1]:
            writing = any(w["start"] <= t <= w["start"] + w["wall_s"] for w in run["writes"])
            (during if writing else outside).append(lat)
    for name, lat in (("while the writer runs", during), ("otherwise", outside)):
        q = statistics.quantiles(lat, n=100)
        print(f"probe wake-up latency {name}: median {1e3 * q[49]:.2f} ms, p99 {1e3 * q[98]:.1f} ms (n={len(lat)})")
    print(f"\nload before: {load}\nload after: {load_after}")
    out = ROOT / "benchmarks" / "results" / "async_save.json"
    summary = {"model": args.model, "batch": args.batch, "cycles": args.cycles, "load": [load, load_after]}
    rank0 = {key: value for key, value in run.items() if key != "probe"}
    payload = {**summary, "cost": cost, "unqueued_cost": unqueued, "cpu_cost": cpu, "rank0": rank0}
    out.write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
