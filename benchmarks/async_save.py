"""The step-time stall of a sharded save every 10 steps, synchronous against ``ZeroConfig.async_save``, through the
Trainer: the ~25M GPT (``GPTConfig.bench25m()``, fp32 AdamW, batch 4 x 128 tokens per rank) at stage 2 on 2 CPU
ranks, ``ModelCheckpoint(every_n_train_steps=10)`` writing under a temporary directory.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/async_save.py [--rounds 2] [--steps 30]

Each round fits the same model three times in the same two ranks, in turn: without saves, with synchronous saves,
with asynchronous ones (paired: the machine's drift between rounds cancels in each round's differences). A step's
time runs from one ``on_train_batch_end`` to the next, so a synchronous save (inside the step's batch end) and the
background writer's competition for the CPU both land in the steps they delay. The stall of a variant is its total
time over steps 3..N minus the run without saves, over the saves made, and as a share of the time of the 10 steps
between two saves. Prints a table and writes ``results/async_save.json``.
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


def _fit(variant: str, steps: int, root: str) -> list[float]:
    config = GPTConfig.bench25m()
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
    data = SyntheticTextDataModule(vocab_size=config.vocab_size, seq_len=128, batch_size=4, num_train=8 * steps)
    trainer.fit(LitGPT(config), data)
    return [b - a for a, b in zip(times.ends, times.ends[1:], strict=False)]


def _rounds(rounds: int, steps: int, root: str) -> list[dict[str, list[float]]]:
    out = []
    for _ in range(rounds):
        out.append({variant: _fit(variant, steps, root) for variant in ("none", "sync", "async")})
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(_rounds, 2, args.rounds, args.steps, root, init_process_group=False, timeout=3000)
    saves = args.steps // EVERY
    rows: dict[str, list[float]] = {"sync": [], "async": []}
    step_times = []
    for round_ in results[0]:  # rank 0's clock
        base = sum(round_["none"][1:])  # steps 3..N (the first interval includes the first step's setup)
        step = statistics.median(round_["none"][1:])
        step_times.append(step)
        for variant in rows:
            stall = (sum(round_[variant][1:]) - base) / saves
            rows[variant].append(stall / (EVERY * step))
    print(f"median step without saves: {statistics.median(step_times):.3f} s (rank 0); a save every {EVERY} steps")
    print("| saves | stall per save as a share of the 10 steps between saves (per round) | median |")
    print("|---|---|---|")
    for variant, shares in rows.items():
        per_round = ", ".join(f"{100 * s:.1f}%" for s in shares)
        print(f"| {variant} | {per_round} | {100 * statistics.median(shares):.1f}% |")
    print(f"\nload before: {load}")
    out = ROOT / "benchmarks" / "results" / "async_save.json"
    out.write_text(json.dumps({"load": load, "every": EVERY, "rounds": results[0], "shares": rows}, indent=1))


if __name__ == "__main__":
    main()
