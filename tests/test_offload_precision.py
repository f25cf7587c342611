"""Memory tiers under every precision: each tier (optimizer state in the host tier's copy path or on disk, half of it
on disk, stage-3 parameter shards on disk or in the host store) trains through the Trainer in bf16-mixed, 16-mixed
and bf16-true as DDP does in that precision, and as ZeRO without tiers does, at every stage it supports; fp16 loss
scaling checks and unscales gradients held by a tier (Note [gradients on disk])."""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch

from tests.harness import run_distributed
from tests.offload_precision_runs import (
    FP16_SCALE,
    OVERFLOW_STEP,
    overflow_in_the_tiers,
    resume_in_precision,
    tiers_in_precision,
)

DISK = {"offload_dir": "offload"}  # relative: under the Trainer's default_root_dir

TOLERANCE = 2e-2
"""Against DDP: the mixed-precision tests' bound (``test_mixed_precision``): DDP keeps fp32 parameters and autocasts,
ZeRO stores them in low precision, so the two agree to the low precision's rounding, not bit for bit."""
EXACT = 1e-5
"""Against ZeRO without tiers at the same stage, with the same kernels (the fused ones where the optimizer's state is
in a tier, Note [tier step kernels]): a tier moves bytes, it must not change a number."""


def _variants(stage: int) -> dict[str, dict[str, Any]]:
    variants: dict[str, dict[str, Any]] = {
        f"stage{stage}_cpu_copies": {"stage": stage, "offload_optimizer": "cpu", "copies": True},
        f"stage{stage}_disk": {"stage": stage, "offload_optimizer": "disk", **DISK},
        f"stage{stage}_disk_half": {"stage": stage, "offload_optimizer": "disk", "offload_ratio": 0.5, **DISK},
    }
    if stage == 3:
        variants["stage3_params_disk"] = {"stage": 3, "offload_params": "disk", **DISK}
        variants["stage3_both_disk"] = {"stage": 3, "offload_optimizer": "disk", "offload_params": "disk", **DISK}
        variants["stage3_params_cpu_copies"] = {"stage": 3, "offload_params": "cpu", "copies": True}
        variants["stage3_both_cpu_half_copies"] = {
            "stage": 3,
            "offload_optimizer": "cpu",
            "offload_params": "cpu",
            "offload_ratio": 0.5,
            "copies": True,
        }
    return variants


def _assert_close(label: str, run: dict[str, Any], reference: dict[str, Any], tolerance: float) -> None:
    assert len(run["losses"]) == len(reference["losses"]) > 0, label
    torch.testing.assert_close(
        torch.tensor(run["losses"]), torch.tensor(reference["losses"]), rtol=tolerance, atol=0, msg=label
    )
    for name, value in reference["weights"].items():
        torch.testing.assert_close(
            run["weights"][name].float(), value.float(), rtol=tolerance, atol=tolerance, msg=f"{label}: {name}"
        )


DDP_RUNS: dict[str, list[dict[str, Any]]] = {}
"""Each rank's DDP run per precision: it does not depend on the stage, so the first case of a precision trains it and
the other stages compare with the same run."""


@pytest.mark.timeout(400)
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "bf16-true"])
def test_every_tier_trains_in_every_precision_as_ddp_and_as_zero_without_tiers(precision, stage):
    variants = _variants(stage)
    train_ddp = precision not in DDP_RUNS
    with tempfile.TemporaryDirectory() as root:
        ranks = run_distributed(
            tiers_in_precision, 2, root, precision, [stage], variants, train_ddp, init_process_group=False, timeout=380
        )
    if train_ddp:
        DDP_RUNS[precision] = [runs["ddp"] for runs in ranks]
    for runs, ddp_run in zip(ranks, DDP_RUNS[precision], strict=True):
        runs["ddp"] = ddp_run  # a DDP run that raised fails every stage's case below, naming it
        crashed = {k: r["error"] for k, r in runs.items() if "error" in r}
        assert crashed == {}, "\n".join(f"{k}: {runs[k]['trace']}" for k in crashed)
        ddp, untiered = runs["ddp"], runs[f"stage{stage}"]
        _assert_close(f"stage{stage}", untiered, ddp, TOLERANCE)
        _assert_close(f"stage{stage} fused", runs[f"stage{stage}_fused"], ddp, TOLERANCE)
        for label, variant in variants.items():
            run = runs[label]
            untiered = runs[f"stage{stage}_fused" if "offload_optimizer" in variant else f"stage{stage}"]
            on_disk = "disk" in (variant.get("offload_optimizer"), variant.get("offload_params"))
            assert (run["tiers"][2] > 0) == on_disk, (label, run["tiers"])  # the tier was used...
            assert (run["host_copies"][0] > 0) == bool(variant.get("copies")), label  # ...and the copy path taken
            _assert_close(f"{label} against DDP", run, ddp, TOLERANCE)
            _assert_close(f"{label} against ZeRO without tiers", run, untiered, EXACT)
            # optimizer.state_dict() reads the state from the tiers: Adam's moments, step counts, as without them
            state, expected = run["optimizer_state"], untiered["optimizer_state"]
            assert state, label
            assert state.keys() == expected.keys(), label
            for i, entries in expected.items():
                for name, value in entries.items():
                    torch.testing.assert_close(state[i][name], value, rtol=EXACT, atol=EXACT, msg=f"{label}: {name}")
            assert run["left"] == [], f"{label} left tier files behind: {run['left']}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("first", "second"),
    [
        ({"stage": 3, "offload_optimizer": "disk", "offload_params": "disk", **DISK}, {"stage": 2}),
        ({"stage": 2}, {"stage": 2, "offload_optimizer": "disk", "offload_ratio": 0.5, **DISK}),
        ({"stage": 3, "offload_params": "cpu", "copies": True}, {"stage": 3, "offload_optimizer": "disk", **DISK}),
    ],
)
def test_bf16_mixed_resumes_from_and_into_the_tiers_as_the_run_straight_through(first, second):
    """The fp32 masters and optimizer state of a checkpoint saved from the tiers (or loaded into them) continue
    the run: its last losses and final weights are those of the run that was not interrupted."""
    with tempfile.TemporaryDirectory() as root:
        for straight, resumed in run_distributed(
            resume_in_precision, 2, root, first, second, "bf16-mixed", init_process_group=False, timeout=280
        ):
            for run in (straight, resumed):
                assert "error" not in run, run.get("trace")
            torch.testing.assert_close(resumed["losses"][-2:], straight["losses"][-2:], rtol=EXACT, atol=0)
            for name, value in straight["weights"].items():
                torch.testing.assert_close(resumed["weights"][name], value, rtol=EXACT, atol=EXACT, msg=name)


OVERFLOWS = {
    "stage2": {"stage": 2},
    "stage2_cpu_copies": {"stage": 2, "offload_optimizer": "cpu", "copies": True},
    "stage3": {"stage": 3},
    "stage3_disk": {"stage": 3, "offload_optimizer": "disk", **DISK},
    "stage3_disk_half": {"stage": 3, "offload_optimizer": "disk", "offload_ratio": 0.5, **DISK},
}


@pytest.mark.timeout(200)
def test_an_overflow_in_gradients_held_by_a_tier_skips_the_step_on_every_rank_as_without_tiers():
    """16-mixed: one rank's gradients overflow at one step. With them in the host tier's buffers or on disk, every
    rank still skips that step and backs off the scale, as without tiers, and training goes on from the same
    weights."""
    with tempfile.TemporaryDirectory() as root:
        ranks = run_distributed(overflow_in_the_tiers, 2, root, OVERFLOWS, init_process_group=False, timeout=180)
    for runs in ranks:
        for label, run in runs.items():
            assert "error" not in run, run.get("trace")
            # 2 micro-batches per step: the step of the overflow backs off once, and no other step does.
            backed_off = [FP16_SCALE] * (2 * OVERFLOW_STEP + 1) + [FP16_SCALE / 2] * (7 - 2 * OVERFLOW_STEP)
            assert run["scales"] == backed_off, label
            assert all(torch.isfinite(w).all() for w in run["weights"].values()), label
        for label in ("stage2_cpu_copies",):
            _assert_close(label, runs[label], runs["stage2"], EXACT)
        for label in ("stage3_disk", "stage3_disk_half"):
            _assert_close(label, runs[label], runs["stage3"], EXACT)
