"""The delayed parameter update's loss curve against the exact step (Note [delayed parameter update]), on the small
GPT of the tier tests, 2 gloo ranks, the host tier's copy path forced on the CPU (as on a GPU):

    PYTHONPATH=$PWD .venv/bin/python benchmarks/offload_overlap_loss.py --steps 40 --warmup 5 \\
        --out benchmarks/results/offload_overlap_loss.json

Prints both curves and their largest relative difference after the warm-up.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.harness import run_distributed
from tests.offload_runs import forced_host_copies, train


def _curves(root: str, steps: int, warmup: int) -> dict[str, list[float]]:
    base = {"stage": 2, "offload_optimizer": "cpu", "bucket_numel": 3_000}
    delayed = {**base, "offload_overlap": "delayed", "offload_overlap_warmup": warmup}
    with forced_host_copies():
        return {
            name: train(s, root, steps=steps, clip=1.0)["losses"] for name, s in (("exact", base), ("delayed", delayed))
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        curves: dict[str, Any] = run_distributed(
            _curves, 2, root, args.steps, args.warmup, init_process_group=False, timeout=1500
        )[0]
    exact, delayed = curves["exact"], curves["delayed"]
    after = [abs(d - e) / e for e, d in zip(exact[args.warmup :], delayed[args.warmup :], strict=True)]
    print("step | exact | delayed")
    for i, (e, d) in enumerate(zip(exact, delayed, strict=True)):
        print(f"{i} | {e:.4f} | {d:.4f}")
    last = slice(-5, None)
    print(f"largest relative difference after the warm-up: {max(after):.4f}; mean of the last 5 steps: exact "
          f"{sum(exact[last]) / 5:.4f}, delayed {sum(delayed[last]) / 5:.4f}")  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps({"argv": sys.argv, **curves, "largest_relative_difference": max(after)}))


if __name__ == "__main__":
    main()
