"""The step-time stall of a sharded save every 10 steps, synchronous against ``ZeroConfig.async_save``, through the
Trainer: a GPT (``--model small``: 3.3M parameters; ``bench25m``: 25M) in fp32 with AdamW, batch 8 x 128 tokens per
rank, at stage 2 on 2 CPU ranks, ``ModelCheckpoint(every_n_train_steps=10)`` writing under a temporary directory.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/async_save.py [--model small] [--rounds 2] [--steps 41]

Each round fits the same model three times in the same two ranks, in turn: without saves, with synchronous saves,
with asynchronous ones. A step's time runs from one ``on_train_batch_end`` to the next, so a synchronous save (inside
the step's batch end) and the background writer's competition for the CPU land in the steps they delay. Each save at
step k is charged the time of steps k..k+4 above the median of steps k-5..k-1 (a local baseline, so the machine's
drift cancels), as a share of the 10 steps between two saves; the same estimator on the run without saves, at the
same steps, is the noise floor. Prints a table and writes ``results/async_save.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from lightning_zero import ZeroStrategy  # noqa: E402
from lightning_zero.models import GPTConfig, LitGPT, SyntheticTextDataModule  # noqa: E402
from tests.harness import run_distributed  # noqa: E402

EVERY = 10


class StepTimes(pl.Callback):
    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.ends.append(time.perf_counter())


def _fit(variant: str, steps: int, root: str, model: str) -> list[float]:
    config = getattr(GPTConfig, model)()
    times = StepTimes()
    callbacks: list[pl.Callback] = [times]
    if variant != "none":
        callbacks.append(ModelCheckpoint(dirpath=f"{root}/{variant}", every_n_train_steps=EVERY, save_top_k=1))
    torch.manual_seed(0)
    trainer = pl.Trainer(
        strategy=ZeroStrategy(stage=2, async_save=variant == "async"),
        accelerator="cpu",
        devices=2,
        max_steps=steps,
        logger=False,
        enable_checkpointing=variant != "none",
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        limit_val_batches=0,
    )
    data = SyntheticTextDataModule(vocab_size=config.vocab_size, seq_len=128, batch_size=8, num_train=16 * steps)
    trainer.fit(LitGPT(config), data)
    return [b - a for a, b in zip(times.ends, times.ends[1:], strict=False)]


def _rounds(rounds: int, steps: int, root: str, model: str) -> list[dict[str, list[float]]]:
    out = []
    for _ in range(rounds):
        out.append({variant: _fit(variant, steps, root, model) for variant in ("none", "sync", "async")})
    return out


def stall_shares(durations: list[float]) -> list[float]:
    """Each save's stall as a share of the 10 steps between saves. ``durations[i]`` is the time from the end of
    step i+1 to the end of step i+2 (1-based steps): the step that saves at step k ends at index k-2."""
    shares = []
    for k in range(EVERY, len(durations) + 2, EVERY):
        i = k - 2
        before = durations[max(i - 5, 0) : i]
        after = durations[i : i + 5]
        if len(before) < 3 or len(after) < 5:
            continue
        baseline = statistics.median(before)
        shares.append(sum(d - baseline for d in after) / (EVERY * baseline))
    return shares


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=41)
    parser.add_argument("--model", default="small", choices=["small", "bench25m"])
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(
            _rounds, 2, args.rounds, args.steps, root, args.model, init_process_group=False, timeout=3000
        )
    shares: dict[str, list[float]] = {"none": [], "sync": [], "async": []}
    steps = []
    for round_ in results[0]:  # rank 0's clock
        steps.append(statistics.median(round_["none"][1:]))
        for variant in shares:
            shares[variant] += stall_shares(round_[variant])
    print(f"{args.model}: median step without saves {statistics.median(steps):.3f} s (rank 0); a save every {EVERY}")
    print("| saves | stall per save / time of the 10 steps between saves (each save) | median |")
    print("|---|---|---|")
    for variant, values in shares.items():
        each = ", ".join(f"{100 * v:+.1f}%" for v in values)
        label = "none (noise floor)" if variant == "none" else variant
        print(f"| {label} | {each} | {100 * statistics.median(values):+.1f}% |")
    print(f"\nload before: {load}")
    out = ROOT / "benchmarks" / "results" / "async_save.json"
    out.write_text(json.dumps({"load": load, "every": EVERY, "rounds": results[0], "shares": shares}, indent=1))


if __name__ == "__main__":
    main()
