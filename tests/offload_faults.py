"""Runs for the memory-tier fault tests, inside ranks started by ``tests.harness.run_distributed``: a disk that fills
up during training, a disk too small to start on."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from lightning_zero.offload import directory, swap_file
from tests.offload_runs import train

TIERS = {"stage": 3, "offload_optimizer": "disk", "offload_params": "disk", "offload_dir": "offload"}


def _own_tier_dirs(root: str, rank: int) -> list[str]:
    offload = Path(root, "offload")
    return sorted(n for n in os.listdir(offload) if f"-rank{rank}-" in n) if offload.exists() else []


class FillDiskAt(pl.Callback):
    """From the start of the step after ``step`` optimizer steps, every tier write fails as on a full disk."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.full = False

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.full = trainer.global_step >= self.step


def disk_fills_during_training(root: str, full_from: int) -> dict[str, Any]:
    """Checkpoints every 2 steps; the disk fills up after ``full_from`` steps. Returns the error, what the tier
    directory holds after it, the checkpoints, a resume from the last one and an uninterrupted run."""
    rank = int(os.environ["RANK"])
    real = os.pwritev
    fill = FillDiskAt(full_from)

    def full_disk(fd: int, buffers: Any, offset: int) -> int:
        if fill.full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, buffers, offset)

    swap_file.os.pwritev = full_disk  # type: ignore[attr-defined]  # this rank process only
    try:
        train(TIERS, root, steps=6, save_to=f"{root}/ckpt", save_every=2, callbacks=[fill])
        failure = None
    except Exception as error:  # the job fails: what does it say?
        failure = f"{type(error).__name__}: {error}"
    finally:
        swap_file.os.pwritev = real  # type: ignore[attr-defined]
    left_after_failure = _own_tier_dirs(root, rank)
    saved = sorted(os.listdir(f"{root}/ckpt")) if os.path.isdir(f"{root}/ckpt") else []
    resumed = train(TIERS, root, steps=6, ckpt_path=f"{root}/ckpt/{saved[-1]}") if saved else None
    straight = train(TIERS, root, steps=6)
    return {
        "failure": failure,
        "left": left_after_failure,
        "saved": saved,
        "resumed": resumed,
        "straight": straight,
    }


def disk_too_small(root: str, free: int) -> dict[str, Any]:
    """The disk reports ``free`` bytes: setup must refuse before writing anything."""
    rank = int(os.environ["RANK"])
    real = directory.free_bytes
    directory.free_bytes = lambda path: free  # type: ignore[assignment]
    try:
        train(TIERS, root, steps=1)
        failure = None
    except Exception as error:
        failure = f"{type(error).__name__}: {error}"
    finally:
        directory.free_bytes = real  # type: ignore[assignment]
    return {"failure": failure, "left": _own_tier_dirs(root, rank)}
