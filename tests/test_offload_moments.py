"""Host masters with the moments on disk (``offload_optimizer_state="disk"``, Note [moments on disk] in
``offload/host_moments.py``): the same steps as the host tier with its moments in memory, bit for bit, and as ZeRO
without tiers; the moments in the tier file; a checkpoint resumes exactly; what cannot compose is refused."""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch

from lightning_zero import ZeroConfig
from tests.harness import run_distributed
from tests.offload_moment_runs import moments_on_disk, resume_with_moments_on_disk


def _assert_same(label: str, run: dict[str, Any], reference: dict[str, Any], tolerance: float) -> None:
    assert len(run["losses"]) == len(reference["losses"]) > 0, label
    torch.testing.assert_close(run["losses"], reference["losses"], rtol=tolerance, atol=0, msg=label)
    for name, value in reference["weights"].items():
        torch.testing.assert_close(
            run["weights"][name], value, rtol=tolerance, atol=tolerance / 10, msg=f"{label}: {name}"
        )


@pytest.mark.timeout(400)
@pytest.mark.parametrize("precision", ["32-true", pytest.param("bf16-mixed", marks=pytest.mark.slow)])
def test_moments_on_disk_step_as_in_host_memory_and_as_without_tiers(precision):
    with tempfile.TemporaryDirectory() as root:
        ranks = run_distributed(moments_on_disk, 2, root, [2, 3], precision, init_process_group=False, timeout=380)
    for runs in ranks:
        for stage in (2, 3):
            plain, host, disk = runs[f"stage{stage}"], runs[f"stage{stage}_host"], runs[f"stage{stage}_disk"]
            _assert_same(f"stage{stage} disk vs host", disk, host, 0.0)  # the same kernel on the same values
            _assert_same(f"stage{stage} disk vs untiered", disk, plain, 1e-5)
            _, in_host, on_disk = disk["tiers"]
            _, host_only, _ = host["tiers"]
            assert on_disk > 0, disk["tiers"]  # the moments' file
            assert in_host < host_only, (disk["tiers"], host["tiers"])  # host memory without the moments
            assert disk["left"] == [], disk["left"]
            assert set(disk["optimizer_state"]) == set(host["optimizer_state"])
            for index, state in host["optimizer_state"].items():  # state_dict() reads them back from the file
                for name, value in state.items():
                    assert torch.equal(disk["optimizer_state"][index][name], value), (stage, index, name)


@pytest.mark.timeout(300)
def test_a_run_with_moments_on_disk_resumes_from_its_checkpoint_exactly():
    with tempfile.TemporaryDirectory() as root:
        for straight, resumed in run_distributed(
            resume_with_moments_on_disk, 2, root, 3, init_process_group=False, timeout=280
        ):
            assert resumed["losses"][-2:] == straight["losses"][-2:]
            for name, value in straight["weights"].items():
                assert torch.equal(resumed["weights"][name], value), name


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"offload_optimizer": "disk"}, "offload_optimizer_state='disk' with offload_optimizer='disk'"),
        ({"offload_optimizer": "none"}, "offload_optimizer_state='disk' with offload_optimizer='none'"),
        (
            {"offload_optimizer": "cpu", "offload_overlap": "delayed"},
            "offload_optimizer_state='disk' with offload_overlap='delayed'",
        ),
    ],
)
def test_moments_on_disk_refuse_what_cannot_compose_naming_both(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        ZeroConfig(stage=2, offload_optimizer_state="disk", offload_dir="/tmp", **fields)
    with pytest.raises(ValueError, match="offload_dir: None with offload_optimizer_state='disk'"):
        ZeroConfig(stage=2, offload_optimizer="cpu", offload_optimizer_state="disk")
