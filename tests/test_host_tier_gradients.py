"""``.grad`` between backward and the step with the optimizer in the host tier, on its copy path (as on an
accelerator, Note [host tier data path]): read from the reduced device shards the tier copies from, as the step will
read them (Note [gradients visible to hooks]). A Fabric loop reads after ``fabric.backward`` and after
``fabric.clip_gradients``, the Trainer's ``on_before_optimizer_step`` reads Lightning's ``grad_norm`` and
``lightning_zero.grad_norm``; both against DDP on 2 gloo ranks, then DDP's weights. With ``offload_overlap="delayed"``
the steps after the warm-up are not DDP's (the update lands a step late): there the reads are checked against the
norm ``fabric.clip_gradients`` takes from the host copies, and the weights against the same run without reads."""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch

from tests import host_tier_gradient_runs as runs
from tests.harness import run_distributed
from tests.test_fabric_gradients import FROZEN, _assert_reads_match, _tolerance

HOST = {"offload_optimizer": "cpu"}
DELAYED = {"offload_optimizer": "cpu", "offload_overlap": "delayed", "offload_overlap_warmup": 1}
WARMUP = 1


def _check_clipped(step: dict[str, Any], precision: str) -> None:
    """The reads after ``fabric.clip_gradients`` are the clipped gradient, as DDP's ``.grad`` after clipping."""
    tolerance = _tolerance(precision)
    norm = step["clip_norm"].float()
    assert float(norm) > runs.CLIP, "the clip scales the gradients"
    torch.testing.assert_close(step["after"]["total"].float(), torch.tensor(runs.CLIP), **tolerance)
    coefficient = runs.CLIP / (norm + 1e-6)
    for name, value in step["before"]["values"].items():
        torch.testing.assert_close(step["after"]["values"][name].float(), value.float() * coefficient, **tolerance)


def check_fabric(ranks: list[dict[str, dict[str, Any]]], labels: list[str], precision: str, delayed: bool) -> None:
    tolerance = _tolerance(precision)
    for rank, per_rank in enumerate(ranks):
        reference = per_rank["ddp"]
        for label in labels:
            run = per_rank[label]
            for k, step in enumerate(run["steps"]):
                assert step["before"]["has_grad"][FROZEN] is False
                assert sum(step["before"]["has_grad"].values()) == 3, (label, k)  # every trainable parameter
                # The total over `.grad` (the device shards) is the norm the clip took from the host copies.
                torch.testing.assert_close(step["before"]["total"].float(), step["clip_norm"].float(), **tolerance)
                _check_clipped(step, precision)
                values = step["before"]["values"]
                for name, value in values.items():  # the averaged gradient: the same on every rank
                    other = ranks[(rank + 1) % len(ranks)][label]["steps"][k]["before"]["values"][name]
                    torch.testing.assert_close(value, other, rtol=0, atol=0)
                if delayed and k >= WARMUP:
                    continue  # the parameters are not DDP's: the update lands a step late
                for moment in ("before", "after"):
                    _assert_reads_match(step[moment], reference["steps"][k][moment], precision)
                torch.testing.assert_close(
                    step["clip_norm"].float(), reference["steps"][k]["clip_norm"].float(), **tolerance
                )
            if delayed:  # reading changes nothing: the weights of the same run without reads, exactly
                for name, value in per_rank[f"{label}-unread"]["weights"].items():
                    assert torch.equal(run["weights"][name], value), (label, name)
                late = [n for n, w in reference["weights"].items() if not torch.allclose(run["weights"][n].float(), w)]
                assert late, "the steps after the warm-up were delayed"
                continue
            for name, expected in reference["weights"].items():
                torch.testing.assert_close(run["weights"][name].float(), expected.float(), **tolerance, msg=name)


def _fabric(precision: str, stages: list[int], fields: dict[str, Any], delayed: bool = False) -> None:
    variants = {f"zero{s}": (f"zero{s}", {**fields}) for s in stages}
    if delayed:
        variants |= {f"zero{s}-unread": (f"zero{s}", {**fields}) for s in stages}
    ranks = run_distributed(runs.fabric_runs, 2, precision, variants, init_process_group=False, timeout=280)
    check_fabric(ranks, [f"zero{s}" for s in stages], precision, delayed)
    assert all(per_rank[label]["warnings"] == [] for per_rank in ranks for label in variants)  # nothing hidden


@pytest.mark.timeout(200)
def test_fabric_host_tier_gradients_read_between_backward_and_step_match_fabric_ddp():
    """Stages 2 and 3, fp32; stage 3 with its gradients on disk too, which are not in memory before the step: no
    ``.grad`` is shown there, and the warning says why (on rank 0, as Lightning warns)."""
    variants = {f"zero{s}": (f"zero{s}", HOST) for s in (2, 3)}
    with tempfile.TemporaryDirectory() as root:
        ranks = run_distributed(runs.fabric_runs, 2, "32-true", variants, root, init_process_group=False, timeout=280)
    check_fabric(ranks, list(variants), "32-true", delayed=False)
    for rank, per_rank in enumerate(ranks):
        assert all(per_rank[label]["warnings"] == [] for label in variants)
        disk = per_rank["disk"]
        for step in disk["shown"]:  # None, or a marker (Note [model.zero_grad() reaches the shards]) refusing reads
            assert all(shown is None or "offload_optimizer='disk'" in shown for shown in step.values()), step
        warned = disk["warnings"]
        if rank == 0:
            assert len(warned) == 1, warned
            assert "kept on disk" in warned[0], warned[0]
            assert "offload_optimizer='disk'" in warned[0], warned[0]
            assert "offload_optimizer='cpu' (the host tier), whose gradients are shown" in warned[0], warned[0]
        # The weights are still DDP's: the clip's norm comes from the disk tier.
        for name, expected in per_rank["ddp"]["weights"].items():
            torch.testing.assert_close(disk["weights"][name], expected, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("precision", "stages", "delayed"),
    [
        ("bf16-mixed", [1, 2, 3], False),
        ("32-true", [1], False),
        ("32-true", [2, 3], True),
        ("bf16-mixed", [2, 3], True),
    ],
)
def test_fabric_host_tier_gradients_in_other_stages_precisions_and_delayed(precision, stages, delayed):
    _fabric(precision, stages, DELAYED if delayed else HOST, delayed)


def check_trainer(ranks: list[dict[str, dict[str, Any]]], precision: str, delayed: bool) -> None:
    rel, atol = (1e-5, 1e-6) if precision == "32-true" else (4e-2, 2e-3)
    for per_rank in ranks:
        reference = per_rank["ddp"]
        assert len(reference["norms"]) == runs.STEPS
        for label, run in per_rank.items():
            if label == "ddp" or label.endswith("-unread"):
                continue
            assert len(run["norms"]) == len(run["lightning_norms"]) == len(run["clip_norms"]) == runs.STEPS
            for k in range(runs.STEPS):
                ours, lightnings = run["norms"][k], run["lightning_norms"][k]
                expected = reference["lightning_norms"][k]
                assert ours.keys() == lightnings.keys() == expected.keys(), label  # `unused`: no gradient, no key
                # The total over `.grad` (the device shards) is the norm the clip takes from the host copies.
                total = float(lightnings["grad_2.0_norm_total"])
                assert total == pytest.approx(float(run["clip_norms"][k]), rel=rel), (label, k)
                assert float(ours["grad_2.0_norm_total"]) == pytest.approx(total, rel=rel), (label, k)
                if delayed and k >= WARMUP:
                    continue  # the parameters are not DDP's: the update lands a step late
                for key, value in expected.items():
                    assert float(lightnings[key]) == pytest.approx(float(value), rel=rel), (label, key)
                    assert float(ours[key]) == pytest.approx(float(value), rel=rel), (label, key)
                torch.testing.assert_close(
                    run["copies"][k].float(), reference["copies"][k].float(), rtol=rel, atol=atol
                )
            if delayed:  # reading changes nothing: the weights of the same run without reads, exactly
                for name, value in per_rank[f"{label}-unread"]["weights"].items():
                    assert torch.equal(run["weights"][name], value), (label, name)
                late = [n for n, w in reference["weights"].items() if not torch.allclose(run["weights"][n], w)]
                assert late, "the steps after the warm-up were delayed"
                continue
            for name, expected in reference["weights"].items():
                torch.testing.assert_close(run["weights"][name], expected, rtol=rel, atol=atol, msg=f"{label} {name}")


def _trainer(precision: str, stages: list[int], delayed: bool = False) -> None:
    fields = DELAYED if delayed else HOST
    variants = {f"zero{s}": {"stage": s, **fields} for s in stages}
    if delayed:
        variants |= {f"zero{s}-unread": {"stage": s, **fields} for s in stages}
    with tempfile.TemporaryDirectory() as root:
        ranks = run_distributed(runs.trainer_runs, 2, root, precision, variants, init_process_group=False, timeout=280)
    check_trainer(ranks, precision, delayed)


@pytest.mark.timeout(200)
def test_trainer_host_tier_gradients_in_on_before_optimizer_step_match_ddp():
    _trainer("32-true", [3])


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("precision", "stages", "delayed"),
    [
        ("32-true", [1, 2], False),
        ("bf16-mixed", [1, 2, 3], False),
        ("32-true", [2, 3], True),
        ("bf16-mixed", [2, 3], True),
    ],
)
def test_trainer_host_tier_gradients_in_other_stages_precisions_and_delayed(precision, stages, delayed):
    _trainer(precision, stages, delayed)
