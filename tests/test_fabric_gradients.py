"""``.grad`` between ``fabric.backward`` and the step under ``Fabric(strategy="zero1"/"zero2"/"zero3")`` reads as under
Fabric's DDP (Note [gradients between backward and step]): a ``ShardedGradient`` for every trainable parameter, None
for frozen ones; norms per tensor, Lightning's ``grad_norm``, ``get_total_norm`` and full copies give DDP's values on
every rank; the steps after those reads give DDP's weights; writes, and a backward after a read, are refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.fabric_gradient_runs import battery
from tests.harness import run_distributed
from tests.lightning_port_fabric_runs import STRATEGIES
from tests.test_precision import BF16_LOSS_RTOL

ZERO = [name for name in STRATEGIES if name != "ddp"]
FROZEN = "_forward_module.module.0.bias"


@pytest.fixture(
    scope="module",
    params=[
        ("32-true", True, False),
        ("bf16-mixed", True, False),
        pytest.param(("32-true", False, True), marks=pytest.mark.slow),
    ],
    ids=["32-true", "bf16-mixed", "32-true-no-overlap-native-collectives"],
)
def runs(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, dict[str, Any]]]]:
    """Each precision in one set of processes; the slow one without ``overlap_comm`` (stage 1's ``.grad`` views kept
    until the step), on NCCL's code path (``LIGHTNING_ZERO_NATIVE_COLLECTIVES=1``)."""
    precision, overlap_comm, native = request.param
    env = {"LIGHTNING_ZERO_NATIVE_COLLECTIVES": "1"} if native else None
    results = run_distributed(battery, 2, precision, overlap_comm, init_process_group=False, timeout=150, env=env)
    return precision, results


def _tolerance(precision: str) -> dict[str, float]:
    """fp32: DDP's numbers to rounding. bf16-mixed: ZeRO's gradients are the bf16 parameters' (DDP's are fp32 under
    autocast), so a norm within the bf16 loss tolerance, an element within a bf16 rounding of the largest."""
    return (
        {"rtol": 1e-5, "atol": 1e-6}
        if precision == "32-true"
        else {"rtol": 4 * BF16_LOSS_RTOL[precision], "atol": 2e-3}
    )


def _assert_reads_match(read: dict[str, Any], reference: dict[str, Any], precision: str) -> None:
    tolerance = _tolerance(precision)
    assert read["has_grad"] == reference["has_grad"]
    assert read["has_grad"][FROZEN] is False
    assert sum(read["has_grad"].values()) == 3  # every trainable parameter, as DDP
    for kind in ("norms", "inf_norms", "values"):
        assert read[kind].keys() == reference[kind].keys()
        for name, expected in reference[kind].items():
            assert type(read[kind][name]) is torch.Tensor, (kind, name)  # a plain tensor, no ShardedGradient
            torch.testing.assert_close(read[kind][name].float(), expected.float(), **tolerance, msg=f"{kind} {name}")
    assert read["grad_norm"].keys() == reference["grad_norm"].keys()
    for key, expected in reference["grad_norm"].items():
        torch.testing.assert_close(read["grad_norm"][key].float(), expected.float(), **tolerance, msg=key)
    torch.testing.assert_close(read["total"].float(), reference["total"].float(), **tolerance)


@pytest.mark.timeout(170)
def test_fabric_gradients_read_between_backward_and_step_match_fabric_ddp(runs):
    precision, results = runs
    tolerance = _tolerance(precision)
    for rank, per_rank in enumerate(results):
        reference = per_rank["ddp"]
        for name in ZERO:
            run = per_rank[name]
            for moment in ("one_backward", "two_backward", "accumulated", "zeroed"):
                _assert_reads_match(run[moment], reference[moment], precision)
            _assert_reads_match(run["reached"], reference["reached"], precision)
            # No gradient reached the second model: DDP leaves None, ZeRO shows zeros (decided without a collective).
            assert reference["unreached"] == []
            assert [float(norm) for norm in run["unreached"]] == [0.0] * 3
            assert all(float(norm) == 0.0 for norm in run["zeroed"]["norms"].values())
            # Every rank read the averaged gradient: the same values on both ranks.
            for name_, value in run["one_backward"]["values"].items():
                torch.testing.assert_close(
                    value, results[1 - rank][name]["one_backward"]["values"][name_], rtol=0, atol=0
                )
            # The step consumes the gradients (ZeroOptimizer.step), and zero_grad() leaves None as under DDP.
            assert all(run["after_step"].values())
            assert all(reference["after_step"].values())
            for param, expected in reference["weights"].items():
                torch.testing.assert_close(run["weights"][param].float(), expected, **tolerance, msg=f"{name} {param}")


@pytest.mark.timeout(170)
def test_fabric_gradients_refuse_writes_and_a_backward_after_a_read(runs):
    _, results = runs
    for per_rank in results:
        for name in ZERO:
            run = per_rank[name]
            for write in ("write", "scale"):  # clip_grad_norm_'s _foreach_mul_, an in-place scaling
                assert run[write] is not None
                assert "would write a parameter's `.grad`" in run[write], run[write]
                assert "fabric.clip_gradients" in run[write], run[write]
            refusal = run["backward_after_read"]
            assert refusal is not None
            assert "`fabric.backward` reached parameters of SGD after their gradients were reduced" in refusal, refusal
            assert "HINT" in refusal, refusal


@pytest.mark.timeout(170)
def test_fabric_gradients_inside_no_backward_sync_are_not_shown(runs):
    """Nothing is reduced inside ``no_backward_sync``: stage 1 shows this rank's local partial sum, as DDP's
    ``no_sync``; stages 2 and 3 show no gradient (None, or the marker of Note [model.zero_grad() reaches the shards],
    which refuses a read), as FSDP2's sharded parameters while they accumulate."""
    precision, results = runs
    for per_rank in results:
        reference = per_rank["ddp"]["accumulating"]
        assert reference[FROZEN] is None
        for name in ZERO:
            accumulating = per_rank[name]["accumulating"]
            assert accumulating[FROZEN] is None
            for param, expected in reference.items():
                if param == FROZEN:
                    continue
                shown = accumulating[param]
                if name == "zero1":
                    assert isinstance(shown, torch.Tensor), (param, shown)
                    torch.testing.assert_close(shown.float(), expected, **_tolerance(precision))
                else:
                    assert shown is None or (isinstance(shown, str) and "no_backward_sync" in shown), (name, shown)
