"""The largest GPT that trains on this machine, per strategy: 2 ranks, fp32 AdamW, seq 128, batch 1, 3 steps.

    .venv/bin/python benchmarks/largest_model.py --strategy zero2 --n-layer 16 --n-embd 2048
    .venv/bin/python benchmarks/largest_model.py --strategy zero3_disk --n-layer 60 --n-embd 2048 \
        --offload-dir /work/offload-bench
    .venv/bin/python benchmarks/largest_model.py --n-embd 2048 --predict 20   # deepest that fits, from the runs

The largest model per strategy is found by growing ``--n-layer`` at a fixed width: ``--predict GB`` fits peak RSS per
rank as a line in the parameter count through the two deepest runs that fit and prints the deepest model whose two
ranks fit in GB; a run at that depth shows it trains, and a run one layer deeper shows it does not fit.

**What "fits" means.** The run's processes (both ranks) together stay within ``--budget-gb`` of resident memory
(20 GB by default, of the machine's 24 GiB shared with other engineers), and train 3 steps with a finite loss that
falls. The run is the job of ``memory_guard.run_guarded``: this process starts the ranks, samples the summed RSS of
their process tree and the machine's ``MemAvailable`` every 0.2 s, and kills every process of the tree as soon as the
RSS exceeds the budget ("does not fit") or ``MemAvailable`` falls below ``--margin-gib`` (1.5 GiB; the machine is
running out, whoever uses it: "not decided", the kernel's OOM killer never has to choose a victim). A stopped run is
recorded with how far it got, the RSS it had reached, and, from the runs that fit, how much more it would have needed.

Each run appends to ``benchmarks/results/largest_model.json``: per rank, parameters, loss per step, step times, peak
RSS (``VmHWM``, read at the end of training, before teardown), and for the disk tiers the bytes read and written per
step (as issued by the tiers, and as seen by ``/proc/self/io``), the disk space of the tier files, and the disk
bandwidth measured in the same run (a 1 GiB write and read through the same ``preadv``/``pwritev`` path in the run's
directory before training); or one record for a run that was stopped. The run's directory under
``--offload-dir`` (tier files, bandwidth probe) is removed at the end, also when the run was stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from memory_guard import GB, GIB, mem_available, run_guarded, wait_for_memory
from torch.utils.data import DataLoader

import lightning_zero  # noqa: F401  (registers the presets)
from lightning_zero import ZeroStrategy
from lightning_zero.models import GPT, GPTConfig, LitGPT
from lightning_zero.models.lightning_gpt import SyntheticTokenDataset
from lightning_zero.offload.swap_file import SwapFile

RESULTS = Path(__file__).parent / "results" / "largest_model.json"
SEQ, VOCAB, STEPS = 128, 8192, 3
RUN_DIR = "LARGEST_MODEL_RUN_DIR"  # set for the ranks: the run's directory (results, progress, tier files)


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    return 0


def _proc_io() -> tuple[int, int]:
    """Bytes this process read from and caused to be written to storage (``/proc/self/io``; page-cache hits are
    not reads)."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def _disk_usage(directory: Path) -> int:
    """Disk space allocated to the files under ``directory`` (files removed meanwhile count nothing)."""
    total = 0
    with contextlib.suppress(FileNotFoundError):  # a directory removed while walking
        for file in directory.rglob("*"):
            with contextlib.suppress(FileNotFoundError):
                total += file.stat().st_blocks * 512 if file.is_file() else 0
    return total


def disk_bandwidth(directory: Path, nbytes: int = 1 << 30) -> tuple[float, float]:
    """(write, read) bytes per second of the tier IO path on ``directory``."""
    probe = directory / f"bandwidth-probe-{os.getpid()}"
    file = SwapFile(probe)
    data = torch.ones(nbytes // 4)
    try:
        start = time.perf_counter()
        file.write("probe", data)
        file.sync()
        write = nbytes / (time.perf_counter() - start)
        file.drop_cache()  # the read below comes from the disk, not from the page cache
        start = time.perf_counter()
        file.read("probe", data)
        read = nbytes / (time.perf_counter() - start)
    finally:
        file.close()
        probe.unlink(missing_ok=True)
    return write, read


def backstop(floor: int) -> None:
    """Should the guarding process be gone, a rank still ends itself before the machine runs out of memory (below
    the guard's margin, so normally the guard acts first)."""

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if mem_available() < floor:
                print(f"MemAvailable below {floor:,} bytes: ending this rank", flush=True)
                os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def gpt_config(n_layer: int, n_embd: int) -> GPTConfig:
    return GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=n_layer, n_head=n_embd // 128, n_embd=n_embd)


class Record(pl.Callback):
    """Step times, tier bytes and peak RSS per step; the phase reached, in ``progress-rank<r>`` of the run's
    directory (read by the guarding process if it has to stop the run)."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.times: list[float] = []
        self.io: list[tuple[int, int]] = []
        self._start = 0.0
        self._io0 = (0, 0)
        self.peak_rss = 0
        self.setup_peak_rss = 0
        self.step_peak_rss: list[int] = []
        self.proc_io: list[tuple[int, int]] = []
        self.tier_dir_bytes = 0
        self._run_dir = run_dir
        self._progress = run_dir / f"progress-rank{rank}"
        self.progress("building the model and the optimizer")

    def progress(self, phase: str) -> None:
        self._progress.write_text(phase)

    def _io(self, trainer: pl.Trainer) -> tuple[int, int]:
        tiers = getattr(trainer.strategy, "_tiers", None)
        return tiers.io_bytes() if tiers is not None else (0, 0)

    def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.setup_peak_rss = _status("VmHWM:")  # the model built (straight into its tiers) and the optimizers

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.progress(f"step {len(self.times) + 1} of {STEPS}, forward")
        self._hwm_before = _status("VmHWM:")
        Path("/proc/self/clear_refs").write_text("5")  # this step's own peak
        self._start = time.perf_counter()
        self._io0 = self._io(trainer)
        self._proc_io0 = _proc_io()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._start)
        self.step_peak_rss.append(_status("VmHWM:"))
        self.peak_rss = max(self.peak_rss, self.step_peak_rss[-1], self._hwm_before)
        read, written = self._io(trainer)
        self.io.append((read - self._io0[0], written - self._io0[1]))
        read, written = _proc_io()
        self.proc_io.append((read - self._proc_io0[0], written - self._proc_io0[1]))
        self.progress(f"step {len(self.times)} of {STEPS} done")

    def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.peak_rss = max(self.peak_rss, _status("VmHWM:"))
        # Disk space of the run's directory (both ranks' tier files), as allocated.
        self.tier_dir_bytes = _disk_usage(self._run_dir) if trainer.global_rank == 0 else 0
        tiers = getattr(trainer.strategy, "_tiers", None)
        if tiers is not None:
            tiers.restore = lambda: None  # the benchmark never uses the model after fit: skip reading it back


class Losses(LitGPT):
    def __init__(self, *args: Any, record: Record, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.losses: list[float] = []
        self.record = record

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.losses.append(float(loss.detach()))
        self.record.progress(f"step {len(self.losses)} of {STEPS}, backward and optimizer step")
        return loss

    def train_dataloader(self) -> DataLoader:
        # One sequence per rank, the same one every step: "the loss falls" then means the step learned something.
        return DataLoader(SyntheticTokenDataset(num_samples=2, seq_len=SEQ, vocab_size=VOCAB), batch_size=1)


def rank_main(args: argparse.Namespace, run_dir: Path) -> None:
    """One rank of the run (Lightning starts the second one from the first, with the same command line)."""
    torch.set_num_threads(1)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    backstop(floor=1 << 30)
    strategy: Any = "ddp"
    bandwidth = (0.0, 0.0)
    if args.strategy.startswith("zero"):
        extra: dict[str, Any] = {}
        if args.strategy == "zero3_disk":
            extra = {"offload_optimizer": "disk", "offload_params": "disk", "offload_dir": str(run_dir)}
            if rank == 0:
                bandwidth = disk_bandwidth(run_dir)
        strategy = ZeroStrategy(stage=int(args.strategy[4]), **extra)
    record = Record(run_dir, rank)
    module = Losses(gpt_config(args.n_layer, args.n_embd), lr=1e-3, record=record)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        callbacks=[record],
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(run_dir),
    )
    trainer.fit(module)
    result = {
        "strategy": args.strategy,
        "rank": trainer.global_rank,
        "n_layer": args.n_layer,
        "n_embd": args.n_embd,
        "params": sum(p.numel() for p in module.parameters()),
        "losses": module.losses,
        "step_s": record.times,
        "peak_rss_bytes": record.peak_rss,
        "setup_peak_rss_bytes": record.setup_peak_rss,
        "step_peak_rss_bytes": record.step_peak_rss,
        "tier_bytes_per_step": record.io,
        "proc_io_bytes_per_step": record.proc_io,
        "tier_dir_bytes": record.tier_dir_bytes,
        "disk_write_Bps": bandwidth[0],
        "disk_read_Bps": bandwidth[1],
    }
    (run_dir / f"result-rank{trainer.global_rank}.json").write_text(json.dumps(result))


def _runs() -> list[dict[str, Any]]:
    return [json.loads(line) for line in RESULTS.read_text().splitlines()] if RESULTS.exists() else []


def fit_line(strategy: str, n_embd: int) -> tuple[int, int, int, float, float] | None:
    """Through the two deepest runs of ``strategy`` at width ``n_embd`` that fit: (n_layer, params, peak RSS per
    rank of the deeper one, bytes of peak RSS per parameter, parameters per layer); None with fewer than two."""
    by_depth: dict[int, tuple[int, int]] = {}
    for r in _runs():
        if r["strategy"] == strategy and r["n_embd"] == n_embd and r.get("fits", True) and "peak_rss_bytes" in r:
            peak = max(r["peak_rss_bytes"], by_depth.get(r["n_layer"], (0, 0))[1])
            by_depth[r["n_layer"]] = (r["params"], peak)
    if len(by_depth) < 2:
        return None
    (l0, (p0, m0)), (l1, (p1, m1)) = sorted(by_depth.items())[-2:]
    return l1, p1, m1, (m1 - m0) / (p1 - p0), (p1 - p0) / (l1 - l0)


def predict(budget: int, n_embd: int) -> None:
    """Per strategy, the deepest GPT of width ``n_embd`` whose two ranks' peaks fit in ``budget`` (``fit_line``)."""
    for strategy in sorted({r["strategy"] for r in _runs()}):
        line = fit_line(strategy, n_embd)
        if line is None:
            continue
        l1, p1, m1, per_param, per_layer = line
        depth = l1 + math.floor((budget / 2 - m1) / (per_param * per_layer))
        print(
            f"{strategy}: peak RSS per rank = {m1 / GB:.2f} GB at {p1:,} parameters + {per_param:.1f} B per "
            f"parameter; deepest that fits {budget / GB:.1f} GB on 2 ranks: n_layer = {depth} "
            f"({p1 + (depth - l1) * per_layer:,.0f} parameters)"
        )


def guarded_run(args: argparse.Namespace) -> None:
    """Start the ranks under the memory guard, wait for them, and record the run: trained and fits, or stopped."""
    budget, margin = int(args.budget_gb * GB), int(args.margin_gib * GIB)
    with torch.device("meta"):
        params = sum(p.numel() for p in GPT(gpt_config(args.n_layer, args.n_embd)).parameters())
    line = fit_line(args.strategy, args.n_embd)
    predicted = None if line is None else int(line[2] + line[3] * (params - line[1]))  # peak RSS per rank
    expected = int(args.wait_gb * GB) if args.wait_gb else min(budget, 2 * predicted if predicted else budget)
    wait_for_memory(expected + margin, timeout=args.wait_s)
    run_dir = Path(args.offload_dir) / f"largest-model-{os.getpid()}"
    run_dir.mkdir(parents=True)
    env = {**os.environ, RUN_DIR: str(run_dir), "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    try:
        guard = run_guarded([sys.executable, __file__, *sys.argv[1:]], budget=budget, margin=margin, env=env)
        ranks = [json.loads(p.read_text()) for p in sorted(run_dir.glob("result-rank*.json"))]
        progress = [p.read_text() for p in sorted(run_dir.glob("progress-rank*"))]
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    common = {
        "date": started,
        "budget_bytes": budget,
        "margin_bytes": margin,
        "job_peak_rss_bytes": guard.peak_rss_bytes,
        "min_mem_available_bytes": guard.min_mem_available_bytes,
        "wall_s": round(guard.wall_s, 1),
    }
    if guard.stopped is not None or len(ranks) != 2:
        verdict = "does not fit: " if guard.stopped == "budget" else "not decided: "
        verdict += f"{guard.describe()}; rank 0 was at: {progress[0] if progress else 'start'}"
        if guard.stopped is None:
            verdict += f"; the job failed with exit status {guard.returncode}"
        if predicted is not None:
            verdict += (
                f"; the runs that fit predict a peak of {2 * predicted / GB:.2f} GB for the two ranks, "
                f"{max(0, 2 * predicted - guard.rss_at_stop_bytes) / GB:.2f} GB more than reached"
            )
        record = {"strategy": args.strategy, "rank": None, "n_layer": args.n_layer, "n_embd": args.n_embd}
        record |= {"params": params, "fits": False, "verdict": verdict, **common}
        records = [record]
    else:
        peaks = sum(r["peak_rss_bytes"] for r in ranks)
        trains = all(all(map(math.isfinite, r["losses"])) and r["losses"][-1] < r["losses"][0] for r in ranks)
        fits = trains and peaks <= budget
        verdict = (
            f"{'fits' if fits else 'does not fit'}: the two ranks' peaks add up to {peaks / GB:.2f} GB of the "
            f"{budget / GB:.1f} GB budget; loss {'finite and falling' if trains else 'NOT finite and falling'}"
        )
        records = [{**r, "fits": fits, "verdict": verdict, **common} for r in ranks]
    print(records[0]["verdict"], flush=True)
    with open(RESULTS, "a") as out:
        out.writelines(json.dumps(r) + "\n" for r in records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", choices=["ddp", "zero1", "zero2", "zero3", "zero3_disk"])
    parser.add_argument("--n-layer", type=int)
    parser.add_argument("--n-embd", type=int, required=True)
    parser.add_argument("--offload-dir", default="/tmp/lightning_zero_offload", help="the run's directory goes here")
    parser.add_argument("--budget-gb", type=float, default=20.0, help="the two ranks' RSS together may not exceed this")
    parser.add_argument("--margin-gib", type=float, default=1.5, help="stop the run if MemAvailable falls below this")
    parser.add_argument("--wait-s", type=float, default=1800.0, help="wait this long at most for free memory")
    parser.add_argument(
        "--wait-gb",
        type=float,
        help="start once this + the margin is free (default: the peak predicted, or the budget)",
    )
    parser.add_argument("--predict", type=float, metavar="GB", help="print the largest depth that fits GB (no run)")
    args = parser.parse_args()
    if args.predict is not None:
        predict(int(args.predict * GB), args.n_embd)
    elif args.strategy is None or args.n_layer is None:
        parser.error("--strategy and --n-layer are required to run")
    elif RUN_DIR in os.environ:
        rank_main(args, Path(os.environ[RUN_DIR]))
    else:
        guarded_run(args)


if __name__ == "__main__":
    main()
