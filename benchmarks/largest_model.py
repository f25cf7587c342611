"""The largest GPT that trains on this machine, per strategy: 2 ranks, fp32 AdamW, seq 128, batch 1, 3 steps.

    MALLOC_MMAP_THRESHOLD_=65536 .venv/bin/python benchmarks/largest_model.py --strategy zero3_disk \
        --n-layer 40 --n-embd 2560 --offload-dir /work/offload-bench

The largest model per strategy is found by growing ``--n-layer`` at a fixed width: two runs per strategy give peak
RSS per rank as a line in the parameter count, ``--predict GB`` prints the deepest model whose two ranks fit in GB,
and a run at that depth confirms it (a watchdog ends a run that would exhaust the shared machine's memory).

Runs one configuration (``--strategy`` ddp | zero1 | zero2 | zero3 | zero3_disk) and appends a record to
``benchmarks/results/largest_model.json``: parameters, loss per step, step times, peak RSS per rank (read at the end
of training, before teardown), and for the disk tiers the bytes read and written per step and the disk bandwidth
measured in the same run (a 1 GiB write and read through the same ``preadv``/``pwritev`` path in ``offload_dir``
before training). The tier files and the bandwidth probe are removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

import lightning_zero  # noqa: F401  (registers the presets)
from lightning_zero import ZeroStrategy
from lightning_zero.models import GPTConfig, LitGPT
from lightning_zero.models.lightning_gpt import SyntheticTokenDataset
from lightning_zero.offload.swap_file import SwapFile

RESULTS = Path(__file__).parent / "results" / "largest_model.json"
SEQ, VOCAB, STEPS = 128, 8192, 3


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    return 0


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


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def guard_the_machine(trainer: pl.Trainer, floor: int) -> None:
    """The machine is shared: a configuration too large for it ends this rank (and so the job) before the kernel's
    OOM killer picks a process, removing this rank's tier files first."""

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if _mem_available() < floor:
                print(f"MemAvailable below {floor:,} bytes: ending this run (the model does not fit)", flush=True)
                tiers = getattr(trainer.strategy, "_tiers", None)
                if tiers is not None and tiers.path is not None:
                    shutil.rmtree(tiers.path, ignore_errors=True)
                os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


class Record(pl.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self.io: list[tuple[int, int]] = []
        self._start = 0.0
        self._io0 = (0, 0)
        self.peak_rss = 0
        self.setup_peak_rss = 0
        self.step_peak_rss: list[int] = []

    def _io(self, trainer: pl.Trainer) -> tuple[int, int]:
        tiers = getattr(trainer.strategy, "_tiers", None)
        return tiers.io_bytes() if tiers is not None else (0, 0)

    def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.setup_peak_rss = _status("VmHWM:")  # the model built (straight into its tiers) and the optimizers

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._hwm_before = _status("VmHWM:")
        Path("/proc/self/clear_refs").write_text("5")  # this step's own peak
        self._start = time.perf_counter()
        self._io0 = self._io(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._start)
        self.step_peak_rss.append(_status("VmHWM:"))
        self.peak_rss = max(self.peak_rss, self.step_peak_rss[-1], self._hwm_before)
        read, written = self._io(trainer)
        self.io.append((read - self._io0[0], written - self._io0[1]))

    def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.peak_rss = max(self.peak_rss, _status("VmHWM:"))
        tiers = getattr(trainer.strategy, "_tiers", None)
        if tiers is not None:
            tiers.restore = lambda: None  # the benchmark never uses the model after fit: skip reading it back


class Losses(LitGPT):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.losses.append(float(loss.detach()))
        return loss

    def train_dataloader(self) -> DataLoader:
        # One sequence per rank, the same one every step: "the loss falls" then means the step learned something.
        return DataLoader(SyntheticTokenDataset(num_samples=2, seq_len=SEQ, vocab_size=VOCAB), batch_size=1)


def predict(budget: int, n_embd: int) -> None:
    """From the runs recorded so far at width ``n_embd``: per strategy, peak RSS per rank as a line in the parameter
    count through its two largest runs, and the deepest GPT of that width whose two ranks' peaks fit in ``budget``."""
    runs: dict[str, dict[int, tuple[int, int]]] = {}
    for line in RESULTS.read_text().splitlines():
        r = json.loads(line)
        if r["n_embd"] == n_embd:
            peak = max(r["peak_rss_bytes"], runs.get(r["strategy"], {}).get(r["n_layer"], (0, 0))[1])
            runs.setdefault(r["strategy"], {})[r["n_layer"]] = (r["params"], peak)
    for strategy, by_depth in sorted(runs.items()):
        if len(by_depth) < 2:
            continue
        (l0, (p0, m0)), (l1, (p1, m1)) = sorted(by_depth.items())[-2:]
        per_param = (m1 - m0) / (p1 - p0)
        per_layer = (p1 - p0) / (l1 - l0)
        depth = l1 + int((budget / 2 - m1) / (per_param * per_layer))
        print(
            f"{strategy}: peak RSS per rank = {m0 / 1e9:.2f} GB at {p0:,} parameters + {per_param:.1f} B per "
            f"parameter; deepest that fits {budget / 1e9:.1f} GB on 2 ranks: n_layer = {depth} "
            f"({p1 + (depth - l1) * per_layer:,.0f} parameters)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", choices=["ddp", "zero1", "zero2", "zero3", "zero3_disk"])
    parser.add_argument("--n-layer", type=int)
    parser.add_argument("--n-embd", type=int, required=True)
    parser.add_argument("--offload-dir", default="/tmp/lightning_zero_offload")
    parser.add_argument("--predict", type=float, metavar="GB", help="print the largest depth that fits GB (no run)")
    args = parser.parse_args()
    if args.predict is not None:
        predict(int(args.predict * 1e9), args.n_embd)
        return
    if args.strategy is None or args.n_layer is None:
        parser.error("--strategy and --n-layer are required to run")
    torch.set_num_threads(1)
    config = GPTConfig(
        vocab_size=VOCAB, block_size=SEQ, n_layer=args.n_layer, n_head=args.n_embd // 128, n_embd=args.n_embd
    )
    offload = Path(args.offload_dir)
    strategy: Any = "ddp"
    bandwidth = (0.0, 0.0)
    if args.strategy.startswith("zero"):
        stage = int(args.strategy[4])
        extra: dict[str, Any] = {}
        if args.strategy == "zero3_disk":
            offload.mkdir(parents=True, exist_ok=True)
            extra = {"offload_optimizer": "disk", "offload_params": "disk", "offload_dir": str(offload)}
            if os.environ.get("LOCAL_RANK", "0") == "0":
                bandwidth = disk_bandwidth(offload)
        strategy = ZeroStrategy(stage=stage, **extra)
    record = Record()
    module = Losses(config, lr=1e-3)
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
        default_root_dir=str(offload),
    )
    guard_the_machine(trainer, floor=1 << 30)
    trainer.fit(module)
    params = sum(p.numel() for p in module.parameters())
    result = {
        "strategy": args.strategy,
        "rank": trainer.global_rank,
        "n_layer": args.n_layer,
        "n_embd": args.n_embd,
        "params": params,
        "losses": module.losses,
        "step_s": record.times,
        "peak_rss_bytes": record.peak_rss,
        "setup_peak_rss_bytes": record.setup_peak_rss,
        "step_peak_rss_bytes": record.step_peak_rss,
        "tier_bytes_per_step": record.io,
        "disk_write_Bps": bandwidth[0],
        "disk_read_Bps": bandwidth[1],
    }
    print(json.dumps(result), flush=True)
    with open(RESULTS, "a") as out:
        out.write(json.dumps(result) + "\n")
    if trainer.global_rank == 0 and args.strategy == "zero3_disk":
        shutil.rmtree(offload / "lightning_logs", ignore_errors=True)


if __name__ == "__main__":
    main()
