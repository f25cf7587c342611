"""Memory tiers (``lightning_zero.offload``): the optimizer state, masters, gradients and parameter shards in host
memory or on disk train exactly as DDP does, resume across tiers, and leave nothing behind."""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch

from tests.harness import run_distributed
from tests.offload_runs import compare, pretrained_into_tiers, resume_across_tiers, tiered_peaks

DISK = {"offload_dir": "offload"}  # relative: under the Trainer's default_root_dir


def _assert_matches_ddp(runs: list[dict[str, Any]], labels: list[str]) -> None:
    ddp, *tiered = runs
    for label, run in zip(labels, tiered, strict=True):
        assert len(run["losses"]) == len(ddp["losses"]) > 0, label
        torch.testing.assert_close(run["losses"], ddp["losses"], rtol=1e-5, atol=0, msg=label)
        for name, value in ddp["weights"].items():
            torch.testing.assert_close(run["weights"][name], value, rtol=1e-5, atol=1e-6, msg=f"{label}: {name}")
        assert run["left"] == [], f"{label} left tier files behind: {run['left']}"
        _assert_tiers_hold_the_state(label, VARIANTS[label], run["tiers"])


def _assert_tiers_hold_the_state(label: str, variant: dict[str, Any], tiers: tuple[int, int, int]) -> None:
    """The strategy's bytes per tier say where the state went: disk tiers fill the tier file, host tiers are
    counted as host bytes."""
    device, host, disk = tiers
    on_disk = "disk" in (variant.get("offload_optimizer"), variant.get("offload_params"))
    in_host = "cpu" in (variant.get("offload_optimizer"), variant.get("offload_params"))
    assert (disk > 0) == on_disk, (label, tiers)
    assert (host > 0) == in_host, (label, tiers)
    assert device >= 0, (label, tiers)


VARIANTS: dict[str, dict[str, Any]] = {
    "stage1_cpu": {"stage": 1, "offload_optimizer": "cpu"},
    "stage1_disk": {"stage": 1, "offload_optimizer": "disk", **DISK},
    "stage2_disk": {"stage": 2, "offload_optimizer": "disk", **DISK},
    "stage2_disk_half": {"stage": 2, "offload_optimizer": "disk", "offload_ratio": 0.5, **DISK},
    "stage3_cpu": {"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"},
    "stage3_disk": {"stage": 3, "offload_optimizer": "disk", **DISK},
    "stage3_params_disk": {"stage": 3, "offload_params": "disk", **DISK},
    "stage3_both_disk": {"stage": 3, "offload_optimizer": "disk", "offload_params": "disk", **DISK},
    "stage3_both_disk_half": {
        "stage": 3,
        "offload_optimizer": "disk",
        "offload_params": "disk",
        "offload_ratio": 0.5,
        **DISK,
    },
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("clip", "accumulate"), [(0.05, 2)])
def test_tiers_match_ddp_at_every_step_with_clipping_and_accumulation(clip, accumulate):
    variants = [{**v, "bucket_numel": 3_000} for v in VARIANTS.values()]
    with tempfile.TemporaryDirectory() as root:
        runs = run_distributed(compare, 2, root, variants, clip, accumulate, init_process_group=False, timeout=280)
    for rank_runs in runs:
        _assert_matches_ddp(rank_runs, list(VARIANTS))


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("first", "second"),
    [
        ({"stage": 3, "offload_optimizer": "disk", "offload_params": "disk", **DISK}, {"stage": 3}),
        ({"stage": 2}, {"stage": 3, "offload_optimizer": "disk", "offload_params": "disk", **DISK}),
        ({"stage": 1, "offload_optimizer": "disk", **DISK}, {"stage": 3, "offload_params": "disk", **DISK}),
    ],
)
def test_resume_from_a_tiered_checkpoint_into_another_tier_and_back(first, second):
    with tempfile.TemporaryDirectory() as root:
        for straight, resumed in run_distributed(
            resume_across_tiers, 2, root, first, second, init_process_group=False, timeout=180
        ):
            torch.testing.assert_close(resumed["losses"][-2:], straight["losses"][-2:], rtol=1e-5, atol=0)
            for name, value in straight["weights"].items():
                torch.testing.assert_close(resumed["weights"][name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow  # ~1 minute on an idle machine: 2 + 2 models built into the tiers and trained
@pytest.mark.timeout(300)
def test_disk_tiers_keep_peak_rss_flat_while_the_model_grows_four_times(tmp_path):
    """Stage 3 with parameters, masters, optimizer state and gradients on disk: a model 4x deeper (4x the model
    state) trains within the peak resident memory of the small one plus a few units."""
    for (small, small_state), (large, large_state) in run_distributed(
        tiered_peaks, 2, str(tmp_path), [4, 16], 2, timeout=280
    ):
        grown = large_state - small_state
        assert large_state >= 3.5 * small_state  # the model (and its model state) grew ~4x
        unit = large_state // 16 // 4  # one block's fp32 parameter shard on this rank, roughly
        # Without tiers the peak would grow by `grown` (12 more blocks' parameters, gradients and Adam state).
        assert large - small < 0.15 * grown, (small, large, grown)
        assert large < small + 8 * unit, (small, large, unit)


@pytest.mark.timeout(120)
def test_full_pretrained_weights_load_into_the_disk_tiers():
    strategy = {"stage": 3, "offload_optimizer": "disk", "offload_params": "disk", **DISK}
    with tempfile.TemporaryDirectory() as root:
        for saved, loaded in run_distributed(
            pretrained_into_tiers, 2, root, strategy, init_process_group=False, timeout=100
        ):
            assert saved.keys() == loaded.keys()
            for name, value in saved.items():
                torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=name)
