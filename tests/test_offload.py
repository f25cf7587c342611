"""Memory tiers (``lightning_zero.offload``): the optimizer state, masters, gradients and parameter shards in host
memory or on disk train exactly as DDP does, resume across tiers, and leave nothing behind."""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch

from tests.harness import run_distributed
from tests.offload_runs import (
    compare,
    compare_with_host_copies,
    delayed_update_runs,
    host_copies_in_bf16,
    pretrained_into_tiers,
    resume_across_tiers,
    resume_across_tiers_with_host_copies,
    tiered_peaks,
)

DISK = {"offload_dir": "offload"}  # relative: under the Trainer's default_root_dir


def _assert_matches_ddp(
    runs: list[dict[str, Any]], labels: list[str], variants: dict[str, dict[str, Any]] | None = None
) -> None:
    ddp, *tiered = runs
    variants = variants or VARIANTS
    for label, run in zip(labels, tiered, strict=True):
        assert len(run["losses"]) == len(ddp["losses"]) > 0, label
        torch.testing.assert_close(run["losses"], ddp["losses"], rtol=1e-5, atol=0, msg=label)
        for name, value in ddp["weights"].items():
            torch.testing.assert_close(run["weights"][name], value, rtol=1e-5, atol=1e-6, msg=f"{label}: {name}")
        assert run["left"] == [], f"{label} left tier files behind: {run['left']}"
        _assert_tiers_hold_the_state(label, variants[label], run["tiers"])


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
        for label, run in zip(VARIANTS, rank_runs[1:], strict=True):
            assert run["host_copies"] == (0, 0), label  # on the CPU the host tier copies nothing


HOST_COPY_VARIANTS: dict[str, dict[str, Any]] = {
    "stage1_cpu": {"stage": 1, "offload_optimizer": "cpu"},
    "stage2_cpu": {"stage": 2, "offload_optimizer": "cpu"},
    "stage2_cpu_half": {"stage": 2, "offload_optimizer": "cpu", "offload_ratio": 0.5},
    "stage3_cpu": {"stage": 3, "offload_optimizer": "cpu"},
    "stage3_params_cpu": {"stage": 3, "offload_params": "cpu"},
    "stage3_both_cpu": {"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"},
}


@pytest.mark.timeout(300)
def test_host_tier_copy_path_matches_ddp_at_every_step_with_clipping_and_accumulation():
    """The data path a GPU takes (Note [host tier data path]: host masters and gradients, copies down as each
    reduction completes, the step on the host, copies up), forced on the CPU, against DDP at stages 1-3."""
    variants = [{**v, "bucket_numel": 3_000} for v in HOST_COPY_VARIANTS.values()]
    with tempfile.TemporaryDirectory() as root:
        runs = run_distributed(
            compare_with_host_copies, 2, root, variants, 0.05, 2, init_process_group=False, timeout=280
        )
    for rank_runs in runs:
        _assert_matches_ddp(rank_runs, list(HOST_COPY_VARIANTS), HOST_COPY_VARIANTS)
        for label, run in zip(HOST_COPY_VARIANTS, rank_runs[1:], strict=True):
            down, up = run["host_copies"]
            assert down > 0, label  # the path was taken: gradients (or parameter shards) went to host buffers
            assert up > 0, label


@pytest.mark.timeout(200)
@pytest.mark.parametrize("stage", [2, 3])
def test_host_tier_copy_path_in_bf16_steps_exactly_as_the_host_tier_in_memory(stage):
    """bf16 parameters, fp32 host masters: rounding through the staging buffers, clipping the bf16 gradients in fp32
    and adopting edits give the same bits as the same tier without copies."""
    strategy = {"stage": stage, "offload_optimizer": "cpu", "bucket_numel": 3_000}
    if stage == 3:
        strategy["offload_params"] = "cpu"
    with tempfile.TemporaryDirectory() as root:
        for plain, copied in run_distributed(
            host_copies_in_bf16, 2, root, strategy, 0.05, init_process_group=False, timeout=180
        ):
            assert copied["host_copies"][0] > 0
            assert copied["losses"] == plain["losses"]
            for name, value in plain["weights"].items():
                torch.testing.assert_close(copied["weights"][name], value, rtol=0, atol=0, msg=name)


def _assert_resumed_like_straight(resumed: dict, straight: dict) -> None:
    """The run resumed from a checkpoint ends as the straight run does: last two losses and final weights."""
    torch.testing.assert_close(resumed["losses"][-2:], straight["losses"][-2:], rtol=1e-5, atol=0)
    for name, value in straight["weights"].items():
        torch.testing.assert_close(resumed["weights"][name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("first", "second"),
    [
        ({"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"}, {"stage": 2}),
        ({"stage": 1}, {"stage": 2, "offload_optimizer": "cpu"}),
    ],
)
def test_resume_from_and_into_the_host_tier_copy_path(first, second):
    with tempfile.TemporaryDirectory() as root:
        for straight, resumed in run_distributed(
            resume_across_tiers_with_host_copies, 2, root, first, second, init_process_group=False, timeout=180
        ):
            _assert_resumed_like_straight(resumed, straight)


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
            _assert_resumed_like_straight(resumed, straight)


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


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [2, 3])
def test_delayed_update_is_exact_through_warm_up_then_one_step_stale_and_resumes_exactly(stage):
    """Note [delayed parameter update], on the host tier's copy path: the warm-up steps are the exact run's; the
    first delayed step's loss is still the exact one (its weights are those of the last exact update), the later
    ones differ; a run resumed from a checkpoint saved while delayed ends as the run that saved it went on."""
    strategy = {"stage": stage, "offload_optimizer": "cpu", "bucket_numel": 3_000}
    with tempfile.TemporaryDirectory() as root:
        ranks = run_distributed(delayed_update_runs, 2, root, strategy, init_process_group=False, timeout=280)
    for runs in ranks:
        exact, delayed, saved, resumed = (runs[k] for k in ("exact", "delayed", "saved", "resumed"))
        assert delayed["losses"][:3] == exact["losses"][:3]  # 2 exact steps, then the forward before any delay
        assert delayed["losses"][3:] != exact["losses"][3:]  # the step after: weights one update behind
        # Delayed, yet close: the same model trained on the same data.
        torch.testing.assert_close(delayed["losses"], exact["losses"], rtol=0.05, atol=0)
        assert resumed["losses"][-3:] == saved["losses"][-3:]
        for name, value in saved["weights"].items():
            assert torch.equal(resumed["weights"][name], value), name
