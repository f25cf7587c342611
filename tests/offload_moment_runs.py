"""Runs for ``tests/test_offload_moments.py`` (Note [moments on disk]), inside ranks started by
``tests.harness.run_distributed``: the small GPT of ``offload_runs`` through the Trainer without tiers, with the host
tier, and with the host tier's moments on disk."""

from __future__ import annotations

from typing import Any

from tests.offload_runs import forced_host_copies, resume_across_tiers, train

HOST = {"offload_optimizer": "cpu", "bucket_numel": 3_000}
MOMENTS_ON_DISK = {**HOST, "offload_optimizer_state": "disk", "offload_dir": "offload"}


def moments_on_disk(root: str, stages: list[int], precision: str) -> dict[str, dict[str, Any]]:
    """Per stage: ZeRO without tiers (torch's fused AdamW, the host step's kernel), the host tier and the host tier
    with its moments on disk, both on the copy path a GPU takes; clipping and accumulation."""
    runs: dict[str, dict[str, Any]] = {}
    kwargs: dict[str, Any] = {"clip": 0.05, "accumulate": 2, "precision": precision}
    for stage in stages:
        runs[f"stage{stage}"] = train({"stage": stage, "bucket_numel": 3_000}, root, fused=True, **kwargs)
        with forced_host_copies():
            runs[f"stage{stage}_host"] = train({"stage": stage, **HOST}, root, **kwargs)
            runs[f"stage{stage}_disk"] = train({"stage": stage, **MOMENTS_ON_DISK}, root, **kwargs)
    return runs


def resume_with_moments_on_disk(root: str, stage: int) -> list[dict[str, Any]]:
    """Saved with the moments on disk at step 2, resumed with them on disk to step 4; the run straight through."""
    strategy = {"stage": stage, **MOMENTS_ON_DISK}
    with forced_host_copies():
        return resume_across_tiers(root, strategy, strategy)
