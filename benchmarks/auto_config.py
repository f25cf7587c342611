"""``strategy="zero_auto"`` under device budgets that force each of its choices in turn, on the GPT, Llama and LoRA
models of ``tests/peak_runs.py`` (``AUTO_MODELS``), 2 CPU ranks, fp32: the candidate chosen, and the peak the run
then measures against the budget.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/auto_config.py

Each budget leaves, after the 10% headroom, 2% less than the least any earlier candidate needs
(``auto_options``). Each run is a fresh pair of ranks: a 1-step stage-3 warm-up fit of the model class at a tiny
size and the decision's predictions for the model (what a process's first such step and decision leave behind), then
a 2-step ``zero_auto`` fit whose peak anonymous resident memory above the memory before
the model was built is measured (``PeakProbe``). Prints a markdown table and writes ``results/auto_config.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"

from tests.harness import run_distributed  # noqa: E402
from tests.peak_runs import auto_fit, auto_options  # noqa: E402


def main() -> None:
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    rows = []
    print("| model | budget MiB | chosen | measured MiB (rank 0) | measured / budget |")
    print("|---|---|---|---|---|")
    for name in ("gpt", "llama", "lora"):
        with tempfile.TemporaryDirectory() as root:
            for expected, budget in auto_options(name, f"{root}/offload"):
                results = run_distributed(auto_fit, 2, name, budget, root, init_process_group=False, timeout=900)
                run = results[0]
                measured = max(r["measured"] for r in results)
                rows.append(
                    {
                        "model": name,
                        "expected": expected,
                        "budget": budget,
                        "chosen": run["chosen"],
                        "measured": [r["measured"] for r in results],
                    }
                )
                print(
                    f"| {name} | {budget / 2**20:.1f} | {run['chosen']} | {run['measured'] / 2**20:.1f} | "
                    f"{measured / budget:.3f} |",
                    flush=True,
                )
    print(f"\nload before: {load}")
    (ROOT / "benchmarks" / "results" / "auto_config.json").write_text(
        json.dumps({"load": load, "rows": rows}, indent=1)
    )


if __name__ == "__main__":
    main()
