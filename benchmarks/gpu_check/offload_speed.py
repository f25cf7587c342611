"""The GPU check's ZeRO-Offload speed section (``offload_speed``): the largest GPT of ``offload_largest_model``'s
host-tier prediction (width 2048, bf16-mixed, stage 3, world size 1) trained with ``offload_optimizer="cpu"``,
exact and with the delayed update (``offload_overlap="delayed"``, after one exact step), and the largest GPT whose
host masters and disk moments fit (``offload_optimizer_state="disk"``, Note [moments on disk]: 8 bytes per
parameter of host memory and 8 of disk, under ``OUT/moments``), exact; each at batch 1 x 1024 and 8 x 1024 tokens;
per run the median step time, tokens/s, the losses, the host's RSS, and the split of a steady step:

- ``gpu_s``: forward and backward on the device (CUDA events on the compute stream, batch start to the step);
- ``host_adam_s``: the host tier's own updates (``HostSteps.busy_s``, the worker's time in its bucket tasks: the
  gradient's conversion, the fused kernel, the rounding into staging, Note [host step threads]);
- ``copies_bytes``: bytes the host tier copied to the host and to the device in the step;
- ``exposed_s``: the step's wall time less the larger of ``gpu_s`` and ``host_adam_s``: what neither hides;
- ``disk_bytes``: bytes of the tier files read and written in the step (the moments).
"""

from __future__ import annotations

import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from gpu_check.common import Config, brief, memory_available, note, ranks
from gpu_check.gpt import (
    HOST_FRACTION,
    CheckGPT,
    Progress,
    Timer,
    _memory,
    _watch_host_memory,
    num_parameters,
    predict_layers,
    shape,
)

RUNS = [("exact", 1), ("delayed", 1), ("disk_moments", 1), ("exact", 8), ("delayed", 8), ("disk_moments", 8)]
"""(mode, batch): the host tier exact or delayed on the host-tier model, its moments on disk on the larger one;
batch 1 of every mode first, should the budget run out."""
DISK_MOMENTS_HOST = 8
"""Host bytes per parameter with the moments on disk: fp32 master, bf16 gradient (the upload stages through it),
the edit check's buffer and slack for the read-ahead and write-behind moments."""
DISK_FRACTION = 0.85


class StepSplit(pl.Callback):
    """Per step: device time of forward and backward, the host tier's update time and copied bytes."""

    def __init__(self) -> None:
        self.gpu_s: list[float] = []
        self.host_adam_s: list[float] = []
        self.copies: list[int] = []
        self._start: Any = None
        self._end: Any = None
        self._busy = 0.0
        self._copied = 0
        self.disk: list[int] = []
        self._io = 0

    def _tiers(self, trainer: pl.Trainer) -> Any:
        return trainer.strategy.memory_tiers  # type: ignore[attr-defined]

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        tiers = self._tiers(trainer)
        self._busy = sum(h.busy_s for h in tiers.host_steps)
        self._copied = sum(tiers.host_copy_bytes())
        self._io = sum(tiers.io_bytes())
        if module.device.type == "cuda":
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
            self._start.record()

    def on_before_optimizer_step(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        if self._end is not None:
            self._end.record()

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        tiers = self._tiers(trainer)
        if self._end is not None:
            self._end.synchronize()
            self.gpu_s.append(self._start.elapsed_time(self._end) / 1e3)
        self.host_adam_s.append(sum(h.busy_s for h in tiers.host_steps) - self._busy)
        self.copies.append(sum(tiers.host_copy_bytes()) - self._copied)
        self.disk.append(sum(tiers.io_bytes()) - self._io)


def train(config: Config, overlap: str, gpt: dict[str, int], batch: int, warmup: int, steps: int) -> dict[str, Any]:
    """One fit at world size 1 with the host tier (runs in a rank of its own)."""
    from lightning_zero import ZeroStrategy
    from lightning_zero.offload import host_copies

    host_copies.FORCE_COPIES = config.device != "cuda"  # the dry run on the CPU takes the copy path a GPU takes
    _watch_host_memory(config, max(4 << 30, memory_available() // 20))
    if overlap == "disk_moments":  # Note [moments on disk]
        directory = Path(config.out, "moments")
        directory.mkdir(parents=True, exist_ok=True)
        strategy = ZeroStrategy(
            stage=3, offload_optimizer="cpu", offload_optimizer_state="disk", offload_dir=str(directory.resolve())
        )
    else:
        strategy = ZeroStrategy(stage=3, offload_optimizer="cpu", offload_overlap=overlap, offload_overlap_warmup=1)
    timer, split = Timer(warmup), StepSplit()
    begin = time.perf_counter()
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="gpu" if config.device == "cuda" else "cpu",
        devices=1,
        precision="bf16-mixed",
        max_steps=warmup + steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer, split, Progress(config, f"{overlap}_b{batch}", begin)],
    )
    trainer.fit(CheckGPT(gpt, batch, warmup + steps, fsdp2=False, fused=True))
    timed = timer.times[warmup:]
    median = statistics.median(timed) if timed else float("nan")
    gpu = statistics.median(split.gpu_s[warmup:]) if split.gpu_s[warmup:] else None
    adam = statistics.median(split.host_adam_s[warmup:]) if timed else None
    return {
        "overlap": overlap,
        "batch": batch,
        "parameters": num_parameters(gpt),
        "step_s": timer.times,
        "median_step_s": median,
        "tokens_per_s": batch * gpt["block_size"] / median if timed else None,
        "losses": timer.losses,
        "gpu_s": gpu,
        "host_adam_s": adam,
        "copies_bytes": statistics.median(split.copies[warmup:]) if timed else None,
        "exposed_s": median - max(gpu or 0.0, adam or 0.0) if timed else None,
        "disk_bytes": statistics.median(split.disk[warmup:]) if timed else None,
        "host_peak_rss_bytes": _peak_rss(),
    }


def _peak_rss() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) * 1024
    return 0


def offload_speed(config: Config) -> dict[str, Any]:
    (memory,) = ranks(config, _memory, 1, timeout=30)
    layers = predict_layers(config, "zero3_offload_optimizer", memory)
    gpt = shape(config, layers)
    moment_layers = _disk_moments_layers(config, memory)
    shapes = {"exact": gpt, "delayed": gpt, "disk_moments": shape(config, moment_layers)}
    runs: list[dict[str, Any]] = []
    for index, (overlap, batch) in enumerate(RUNS):
        share = config.left() / (len(RUNS) - index)
        if share < (2 if config.dry else 20):
            runs.append({"overlap": overlap, "batch": batch, "skipped": f"no time left ({config.left():.0f} s)"})
            continue
        steps = (1, 2) if config.dry else (2, 3)
        try:
            (result,) = ranks(config, train, 1, overlap, shapes[overlap], batch, *steps, timeout=share)
            runs.append({"trained": True, **result})
        except Exception as error:
            runs.append({"overlap": overlap, "batch": batch, "trained": False, "error": brief(error)})
        note(config, run=runs[-1])
    shutil.rmtree(Path(config.out, "moments"), ignore_errors=True)
    checks = [f"{r['overlap']} batch {r['batch']}: {r['error']}" for r in runs if "error" in r]
    result = {
        "layers": layers,
        "parameters": num_parameters(gpt),
        "disk_moments_layers": moment_layers,
        "disk_moments_parameters": num_parameters(shapes["disk_moments"]),
        "runs": runs,
    }
    return {"result": result, "failed_checks": checks}


def _disk_moments_layers(config: Config, memory: dict[str, int]) -> int:
    """The deepest GPT whose host masters fit as ``predict_layers`` fits the host tier's, at
    ``DISK_MOMENTS_HOST`` bytes per parameter, and whose moments fit ``DISK_FRACTION`` of the free disk under
    ``config.out``."""
    if config.dry:
        return 2
    # The host tier's 4 device bytes per parameter; its host limit is replaced by the two below.
    gpu_layers = predict_layers(config, "zero3_offload_optimizer", {**memory, "host_available": 1 << 62})
    one = shape(config, 1)
    per_layer = num_parameters(shape(config, 2)) - num_parameters(one)
    fixed = num_parameters(one) - per_layer
    free = shutil.disk_usage(config.out).free
    host_layers = int((HOST_FRACTION * memory["host_available"] / DISK_MOMENTS_HOST - fixed) / per_layer)
    disk_layers = int((DISK_FRACTION * free / 8 - fixed) / per_layer)
    return max(1, min(gpu_layers, host_layers, disk_layers))
