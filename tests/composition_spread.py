"""How far two runs that should agree drift apart in low precision: the measurements the composition matrix's
tolerances rest on (``tests/test_composition.py``). Each returns ``composition.distances`` (the largest relative
difference of a step's loss, and of a weight tensor's update) between two runs of one case, largest over ranks."""

from __future__ import annotations

import tempfile
from typing import Any

from tests.composition import NA, Distances, distances
from tests.composition_runs import PARAM_DTYPE, ddp_compressed, ddp_one_rank, ddp_spread, zero_only
from tests.harness import run_distributed

BASE: dict[str, Any] = {
    "stage": 1,
    "optimizer_tier": "none",
    "param_tier": NA,
    "zeropp": NA,
    "accumulate": 1,
    "clip": "none",
    "checkpointing": "none",
    "reshard_root": NA,
    "manual": False,
}
"""The factors the measurements do not vary (they run DDP, or ZeRO at stage 3 for the quantization's)."""


def _trained(*runs: dict[str, Any]) -> None:
    for run in runs:
        assert "error" not in run, f"{run['error']}\n{run['where']}"


def _largest(pairs: list[Distances]) -> tuple[float, float]:
    return max(p.loss for p in pairs), max(p.weight for p in pairs)


def one_rank_against_two(case: dict[str, Any]) -> tuple[float, float]:
    """DDP on 2 ranks against DDP on 1 rank with both ranks' batches: the same sums over the batch, taken in
    another order (the loss compared is the mean of the 2 ranks')."""
    with tempfile.TemporaryDirectory() as root:
        two = run_distributed(ddp_spread, 2, case, root, init_process_group=False, timeout=200)
    with tempfile.TemporaryDirectory() as root:
        (one,) = run_distributed(ddp_one_rank, 1, case, root, init_process_group=False, timeout=200)
    _trained(*two, one)
    mean = [sum(step) / 2 for step in zip(two[0]["losses"], two[1]["losses"], strict=True)]
    found = distances({**two[0], "losses": mean}, one, PARAM_DTYPE[case["precision"]])
    return found.loss, found.weight


def compressed_against_plain(case: dict[str, Any]) -> tuple[float, float]:
    """DDP with its gradients averaged in the parameter dtype against plain DDP (``ddp_compressed``)."""
    with tempfile.TemporaryDirectory() as root:
        ranks = run_distributed(ddp_compressed, 2, case, root, init_process_group=False, timeout=200)
    dtype = PARAM_DTYPE[case["precision"]]
    _trained(*(r["compressed"] for r in ranks), *(r["plain"] for r in ranks))
    return _largest([distances(r["compressed"], r["plain"], dtype) for r in ranks])


def quantized_against_exact(case: dict[str, Any]) -> tuple[float, float]:
    """ZeRO++ qwZ+qgZ against plain stage 3 on the same 4 ranks (2 nodes x 2), both read exactly: what quantizing
    the traffic changes in training."""
    quantized = {**case, "stage": 3, "param_tier": "none", "reshard_root": True, "zeropp": "qwz_qgz"}
    with tempfile.TemporaryDirectory() as root:
        plain = run_distributed(
            zero_only, 4, {**quantized, "zeropp": "off"}, root, True, 4, init_process_group=False, timeout=300
        )
    with tempfile.TemporaryDirectory() as root:
        runs = run_distributed(zero_only, 4, quantized, root, True, init_process_group=False, timeout=300)
    dtype = PARAM_DTYPE[case["precision"]]
    _trained(*runs, *plain)
    return _largest([distances(q, p, dtype) for q, p in zip(runs, plain, strict=True)])
