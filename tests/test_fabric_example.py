"""Fabric scripts launched as users launch them: ``examples/fabric_train.py`` end to end, by Fabric's command line with
ZeRO's names (``python -m lightning_zero fabric-run --strategy zero3``) and by itself; a failing rank named in the
others' errors."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.test_example import ROOT, finish, start

EXAMPLE = ROOT / "examples" / "fabric_train.py"
FAST = ["--model", "tiny", "--steps", "4", "--print-every", "1"]


def _run(command: list[str], cwd: Path, timeout: float = 100.0) -> str:
    # One thread per process: fabric-run's default (the cores over the processes) oversubscribes a shared machine.
    code, output = finish(start(command, cwd, {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}), timeout)
    assert code == 0, f"{' '.join(command)} exited with {code}:\n{output}"
    return output


def _losses(output: str) -> list[float]:
    return [float(m) for m in re.findall(r"^step +\d+/\d+ +loss ([\d.]+)", output, flags=re.MULTILINE)]


@pytest.mark.timeout(120)
def test_fabric_run_with_strategy_zero3_trains_the_example_and_saves_a_checkpoint(tmp_path):
    cli = [sys.executable, "-m", "lightning_zero", "fabric-run", "--strategy", "zero3", "--accelerator", "cpu"]
    output = _run([*cli, "--devices", "2", str(EXAMPLE), *FAST, "--checkpoint", "ck"], tmp_path)
    assert "ZeroFabricStrategy on 2 processes" in output
    losses = _losses(output)
    assert len(losses) == 4
    assert losses[-1] < losses[0]
    assert (tmp_path / "ck" / "lightning_state.pt").is_file()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_example_under_zero_gives_fabric_ddp_losses_and_resumes(tmp_path):
    ddp = _losses(_run([sys.executable, str(EXAMPLE), "--strategy", "ddp", *FAST], tmp_path))
    for strategy in ("zero1", "zero2", "zero3"):
        assert _losses(_run([sys.executable, str(EXAMPLE), "--strategy", strategy, *FAST], tmp_path)) == ddp
    first = [sys.executable, str(EXAMPLE), *FAST[:2], "--checkpoint", "ck", "--steps", "2", "--print-every", "1"]
    _run(first, tmp_path)
    resumed = _run([sys.executable, str(EXAMPLE), *FAST, "--checkpoint", "ck"], tmp_path)
    assert "resumed from ck at step 2" in resumed
    assert len(_losses(resumed)) == 2


FAILING = """
import torch
from lightning.fabric import Fabric
from lightning_zero import ZeroFabricStrategy

fabric = Fabric(strategy=ZeroFabricStrategy(stage=2, collective_timeout_s=20), accelerator="cpu", devices=2)
fabric.launch()
model = fabric.setup_module(torch.nn.Linear(4, 4))
if fabric.global_rank == 1:
    raise ValueError("rank 1 broke its data loader")
fabric.all_reduce(torch.ones(1))
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_rank_that_fails_is_named_in_the_error_of_the_rank_waiting_for_it(tmp_path):
    (tmp_path / "failing.py").write_text(FAILING)
    code, output = finish(start([sys.executable, "failing.py"], tmp_path, {"PYTHONPATH": str(ROOT)}), 100)
    assert code != 0
    assert "Rank 1 failed first with ValueError: rank 1 broke its data loader" in output, output
