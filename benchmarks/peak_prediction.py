"""The peak memory per rank that ``python -m lightning_zero estimate`` predicts (a training step on fake tensors,
Note [predicted peak]) against the peak a Trainer run measures, for the project's GPT, a Hugging Face Llama and a
peft LoRA of it, at stages 1-3, with and without activation checkpointing, on 2 CPU ranks in fp32.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/peak_prediction.py

Each configuration runs in two fresh ranks (``tests/harness.py``): a 1-step fit of the same model class at a tiny
size (which starts the thread pools, allocator arenas and code pages a process's first step adds), then a 3-step fit
whose peak anonymous resident memory above the memory before the model was built is measured (``tests/peak_runs.py``,
glibc's mmap threshold at 64 KiB so freed tensors leave the resident set), then the prediction for the same
configuration and micro-batch. Prints a markdown table and writes ``results/peak_prediction.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"

from tests.harness import run_distributed  # noqa: E402
from tests.peak_runs import predicted_and_measured  # noqa: E402

MODELS = ("gpt", "llama", "lora")


def main() -> None:
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    rows = []
    print("| model | stage | checkpointing | predicted MB | measured MB (rank 0) | measured MB (rank 1) | ratio |")
    print("|---|---|---|---|---|---|---|")
    for name in MODELS:
        for stage in (1, 2, 3):
            for checkpointing in (False, True):
                results = run_distributed(
                    predicted_and_measured, 2, name, stage, checkpointing, init_process_group=False, timeout=900
                )
                predicted, measured, split = results[0]
                ratio = predicted / measured
                rows.append(
                    {
                        "model": name,
                        "stage": stage,
                        "checkpointing": checkpointing,
                        "predicted": predicted,
                        "measured": [r[1] for r in results],
                        "split": split,
                        "ratio": ratio,
                    }
                )
                print(
                    f"| {name} | {stage} | {'yes' if checkpointing else 'no'} | {predicted / 1e6:.1f} | "
                    f"{measured / 1e6:.1f} | {results[1][1] / 1e6:.1f} | {ratio:.3f} |",
                    flush=True,
                )
    ratios = [r["ratio"] for r in rows]
    print(f"\nratio predicted / measured: {min(ratios):.3f} - {max(ratios):.3f}; load before: {load}")
    out = ROOT / "benchmarks" / "results" / "peak_prediction.json"
    out.write_text(json.dumps({"load": load, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
