"""``scripts/gpu_check.sh`` in its dry mode on the CPU (tiny sizes): every section runs its code between GPU runs,
so the one call a GPU machine makes does not fail on something the CPU could have caught.

The dry mode's own budgets end it within 95 s; on an idle 2-core machine it needs about 40 s plus the throughput
section's. The tests triple the
budgets (``--budget-scale 3``) so that a machine loaded by other jobs makes no section run out of time."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = [
    "environment",
    "gloo_cuda_probe",
    "gpu_tests",
    "host_syncs",
    "gpt_stage3_vs_fsdp2",
    "full_save_nccl",
    "offload_largest_model",
    "offload_speed",
    "gpt_throughput",
]


def _check(out: Path, *args: str, timeout: float) -> tuple[dict, float]:
    start = time.monotonic()
    command = ["bash", str(ROOT / "scripts/gpu_check.sh"), "--device", "cpu", "--dry", "--budget-scale", "3"]
    command += [*args, str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (out / "summary.md").is_file()
    return json.loads((out / "summary.json").read_text()), time.monotonic() - start


@pytest.mark.timeout(400)
def test_dry_run_reports_every_section_and_goes_on_after_a_failing_one(tmp_path):
    summary, seconds = _check(tmp_path, "--inject-failure", "gloo_cuda_probe", timeout=330)
    sections = summary["sections"]
    assert list(sections) == SECTIONS
    failed = sections.pop("gloo_cuda_probe")
    assert failed["status"] == "failed", failed
    assert "injected failure" in failed["error"], failed
    for name, record in sections.items():  # the sections after the failed one ran
        assert record["status"] == "ok", (name, record)
    tests = sections["gpu_tests"]["result"]["tests"]
    assert len(tests) >= 15, tests  # every gpu test was collected and reported, each skipped with its reason
    assert all(t["outcome"] == "skipped" and t["reason"] for t in tests.values()), tests
    assert sections["environment"]["result"]["hydra_imported_by_lightning_zero"] == []
    syncs = sections["host_syncs"]["result"]["runs"]
    assert syncs["stage1 32-true"]["syncs_per_step"] == 0, syncs  # the README's budget, counted on the CPU
    assert syncs["stage3 bf16-mixed"]["syncs_per_step"] == 0, syncs  # edits adopted by a masked copy, no read
    assert syncs["stage3 16-mixed"]["syncs_per_step"] == 1, syncs  # the overflow check
    throughput = sections["gpt_throughput"]["result"]
    for group, variants in (("tiny eager", ("unsharded", "ddp", "zero1", "zero2", "zero3", "fsdp2")),
                            ("tiny compiled", ("zero3", "fsdp2"))):  # fmt: skip
        runs = throughput[group]
        assert all(runs[v]["tokens_per_s"] > 0 for v in variants), runs
    assert set(sections["gpt_stage3_vs_fsdp2"]["result"]["runs"]) == {"zero3", "fsdp2"}
    assert len(sections["full_save_nccl"]["result"]["per_rank"]) == 2  # the dry run: two gloo ranks
    largest = sections["offload_largest_model"]["result"]["largest_trained_parameters"]
    assert all(largest.values()), largest
    speed = sections["offload_speed"]["result"]["runs"]  # every mode, each trained or skipped for time
    assert {(r["overlap"], r["batch"]) for r in speed} == {
        (m, b) for m in ("exact", "delayed", "disk_moments") for b in (1, 8)
    }
    assert all(r.get("trained") or "skipped" in r for r in speed), speed
    markdown = (tmp_path / "summary.md").read_text()
    assert all(f"| {name} |" in markdown for name in SECTIONS)
    print(f"dry run: {seconds:.1f} s")


@pytest.mark.slow  # 13 s; the dry run above, with a failing section, runs by default
@pytest.mark.timeout(120)
def test_a_hanging_section_is_ended_by_its_budget_and_recorded(tmp_path):
    summary, _ = _check(tmp_path, "--only", "environment", "--inject-hang", "environment", timeout=100)
    record = summary["sections"]["environment"]
    assert record["status"] == "failed", record
    assert "did not finish" in record["error"], record
    assert record["seconds"] < 20, record  # a hanging section gets 8 s
