"""What every section of the GPU check shares: its configuration, its notes, and how it starts ranks."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from tests.harness import DistributedTestError, run_distributed

T = TypeVar("T")
ROOT_OF = str(Path(__file__).resolve().parents[2])
"""The repository's root."""


@dataclass(frozen=True)
class Config:
    out: str
    device: str
    """"cuda" or "cpu"."""
    dry: bool
    """Tiny sizes (the CPU test); the code paths are the GPU run's."""
    inject_failure: str = ""
    inject_hang: str = ""
    offload_modes: tuple[str, ...] = ()
    """``offload_largest_model``: the modes to run (empty: every one), e.g. after an earlier run settled the others."""
    offload_layers: int = 0
    """``offload_largest_model``: the depth each mode starts at (0: the depth its byte count predicts)."""
    section: str = ""
    deadline: float = 0.0
    """``time.time()`` by which the section must be done (the same clock in every process)."""

    def with_budget(self, seconds: float, section: str) -> Config:
        return dataclasses.replace(self, section=section, deadline=time.time() + seconds)

    def left(self) -> float:
        """Seconds left of this section's budget."""
        return self.deadline - time.time()

    @property
    def notes(self) -> Path:
        return Path(self.out) / f".{self.section}.notes.jsonl"

    def rank_device(self) -> torch.device:
        return torch.device("cuda", 0) if self.device == "cuda" else torch.device("cpu")


class Ledger:
    """Partial results of a section, one JSON line each, written as they are found by any of its processes: what a
    section that fails or runs out of time still reports."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.unlink(missing_ok=True)

    def read(self) -> list[Any]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def note(config: Config, **values: Any) -> None:
    """Append a partial result to the section's ledger (from the orchestrator or from a rank)."""
    with open(config.notes, "a") as file:
        file.write(json.dumps(values, default=str) + "\n")


def _entry(config: Config, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
    if config.inject_hang == config.section:
        while True:  # tests only: a hung rank, which the section's budget must end
            time.sleep(1)
    return fn(config, *args)


def ranks(
    config: Config, fn: Callable[..., T], world: int, *args: Any, timeout: float | None = None, group: bool = False
) -> list[T]:
    """``fn(config, *args)`` on ``world`` fresh ranks (``tests.harness.run_distributed``), killed with a stack dump
    when ``timeout`` (by default all that is left of the section's budget) runs out. ``group``: the ranks join a
    gloo group first; otherwise ``fn`` (or Lightning) creates what it needs."""
    left = config.left() - 1
    seconds = min(timeout, left) if timeout is not None else left
    if seconds < 3:
        raise TimeoutError(f"no time left in section {config.section!r} for {getattr(fn, '__name__', fn)}")
    env = {"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    return run_distributed(
        _entry, world, config, fn, args, timeout=seconds, init_process_group=group, collective_timeout=60, env=env
    )


def nccl_or_gloo(config: Config) -> torch.device:
    """In a rank: this rank's device and a default group of the harness's world on it (NCCL on CUDA)."""
    device = config.rank_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.distributed.init_process_group("nccl", device_id=device)
    else:
        torch.distributed.init_process_group("gloo")
    return device


def memory_available() -> int:
    """The host's MemAvailable, in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def environment_variables() -> dict[str, str]:
    keys = ("CUDA_VISIBLE_DEVICES", "NCCL_DEBUG", "OMP_NUM_THREADS", "PYTORCH_CUDA_ALLOC_CONF")
    return {k: os.environ[k] for k in keys if k in os.environ}


def brief(error: BaseException) -> str:
    """One line for a failed run: the exception of the first failed rank, or why it was killed."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not isinstance(error, DistributedTestError):
        return f"{type(error).__name__}: {lines[0] if lines else ''}"[:400]
    for line in lines:
        if line.startswith(("did not finish", "still running", "exited with", "died from")):
            return f"{lines[0]}: {line}"[:400]
    exceptions = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Interrupt|Exit)\b", line)]
    return f"{lines[0]}: {exceptions[-1] if exceptions else ''}"[:400]
