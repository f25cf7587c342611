"""Fabric gets the Trainer's delayed parameter update and asynchronous saves (Note [delayed update in a Fabric loop],
Note [asynchronous saves in a Fabric loop]), checked against the Trainer's runs and synchronous saves on 2 gloo
ranks."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_zero.cli.consolidate import consolidate_checkpoint
from tests import fabric_offload_runs as runs
from tests.harness import DistributedTestError, run_distributed

ROOT = Path(__file__).resolve().parents[1]


def _delayed(stage: int, precision: str, one_file: bool = False) -> None:
    with tempfile.TemporaryDirectory() as root:
        ranks = run_distributed(
            runs.delayed_runs, 2, root, stage, precision, one_file, init_process_group=False, timeout=280
        )
    for rank in ranks:
        trainer, fabric, resumed = rank["trainer"], rank["fabric"], rank["resumed"]
        # The warm-up's 2 steps are exact, every later step leaves its update in flight (the save after step 3
        # publishes it, and step 4 starts a new one).
        assert fabric["in_flight"] == [False, False, True, True, True, True]
        assert resumed["in_flight"] == [True, True, True]  # the resumed run's steps 4-6 are delayed too
        assert fabric["losses"] == trainer["losses"]  # the Trainer's delayed run, step by step
        assert fabric["weights"].keys() == trainer["weights"].keys()
        for name, value in trainer["weights"].items():
            assert torch.equal(fabric["weights"][name], value), name
        assert resumed["losses"] == fabric["losses"][runs.SAVE_AT :]
        for kind in ("weights", "state"):
            for name, value in fabric[kind].items():
                assert torch.equal(resumed[kind][name], value), (kind, name)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("stage", "precision"), [(2, "32-true"), (3, "bf16-mixed")])
def test_fabric_delayed_update_is_the_trainers_step_by_step_and_resumes_exactly(stage, precision):
    _delayed(stage, precision)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("stage", "precision", "one_file"), [(3, "32-true", False), (2, "bf16-mixed", True)])
def test_fabric_delayed_update_in_the_other_stage_and_precision(stage, precision, one_file):
    """The other two combinations; bf16-mixed saving one file (``state_dict_type="full"``), whose counts of steps
    taken resume the run exactly too."""
    _delayed(stage, precision, one_file)


def _check_async_save(ranks: list[dict[str, Any]], with_sync: bool) -> None:
    consolidated = ranks[0]["consolidated"]
    for step in (2, 4):
        saved = consolidated[f"async-{step}"]
        assert saved["step"] == step
        if with_sync:
            expected = consolidated[f"sync-{step}"]
            assert saved.keys() == expected.keys()
            assert saved["state_dict"].keys() == expected["state_dict"].keys()
            for name, value in expected["state_dict"].items():
                assert torch.equal(saved["state_dict"][name], value), (step, name)
    final = consolidated["async-4"]["state_dict"]  # the last save holds the final weights
    for rank in ranks:
        assert rank["resumed"]["step"] == 2
        for name, value in rank["async"]["weights"].items():
            assert torch.equal(final[name], value.float()), name
            assert torch.equal(rank["resumed"]["weights"][name], value), name
            if with_sync:
                assert torch.equal(rank["sync"]["weights"][name], value), name


@pytest.mark.timeout(200)
def test_fabric_async_save_holds_the_state_it_was_asked_at_and_resumes_exactly():
    """``fabric.save`` with async_save returns after staging and training goes on while the bytes are written: the
    last checkpoint, consolidated by the CLI's function, holds the final weights, and a synchronous run resumed from
    the first (after step 2, written while steps 3 and 4 ran) reaches them bit for bit."""
    with tempfile.TemporaryDirectory() as root:
        ranks = run_distributed(runs.async_save_runs, 2, root, 3, False, init_process_group=False, timeout=180)
    _check_async_save(ranks, with_sync=False)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 3])
def test_fabric_async_save_writes_what_a_synchronous_save_writes(stage):
    """Beside the synchronous run's saves at the same steps: the same tensors in every checkpoint."""
    with tempfile.TemporaryDirectory() as root:
        ranks = run_distributed(runs.async_save_runs, 2, root, stage, True, init_process_group=False, timeout=280)
    _check_async_save(ranks, with_sync=True)


@pytest.mark.timeout(120)
def test_a_failed_async_write_fails_on_every_rank_and_commits_nothing(tmp_path):
    """The writer process killed after the first save: the second fails on both ranks, raised by the teardown that
    waits for it, and only the first is in the directory."""
    with pytest.raises(DistributedTestError) as failed:
        run_distributed(runs.lose_the_writer, 2, str(tmp_path), init_process_group=False, timeout=90, grace=30)
    assert sorted(failed.value.failures) == [0, 1]
    for failure in failed.value.failures.values():
        assert "step-4 failed: OSError: the checkpoint writer process exited" in failure
    assert sorted(p.name for p in (tmp_path / "async").iterdir()) == ["step-2"]


def _end_with_a_save_in_flight(tmp_path: Path, outcome: str) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    script = [sys.executable, "-c", runs.EXIT_SCRIPT, str(tmp_path / "ckpt"), outcome]
    done = subprocess.run(script, env=env, cwd=tmp_path, stderr=subprocess.PIPE, timeout=100, check=False)
    return done.returncode, done.stderr.decode()


@pytest.mark.timeout(120)
def test_a_fabric_script_ending_with_a_save_in_flight_commits_it(tmp_path):
    """Fabric calls no teardown: the process waits for the save in flight as it ends (Note [asynchronous saves in a
    Fabric loop]); without that wait the write was stopped with the process and nothing was committed."""
    status, stderr = _end_with_a_save_in_flight(tmp_path, "ok")
    assert status == 0, stderr[-3000:]
    saved = torch.load(consolidate_checkpoint(tmp_path / "ckpt", tmp_path / "ckpt.pt"), weights_only=True)
    assert saved["state_dict"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_fabric_script_ending_with_a_failing_save_in_flight_exits_1(tmp_path):
    status, stderr = _end_with_a_save_in_flight(tmp_path, "fail")
    assert status == 1
    assert "the asynchronous checkpoint save still in flight when the process ended failed" in stderr
    assert "the disk is full" in stderr
    assert not (tmp_path / "ckpt").exists()


def test_fabric_refuses_what_the_trainer_refuses_naming_both_options(tmp_path):
    from lightning_zero import ZeroFabricStrategy, ZeroStrategy

    delayed = {"offload_optimizer": "cpu", "offload_overlap": "delayed"}
    for front_door in (ZeroStrategy, ZeroFabricStrategy):
        with pytest.raises(ValueError, match=r"offload_optimizer_state='disk' with offload_overlap='delayed'"):
            front_door(stage=2, **delayed, offload_optimizer_state="disk", offload_dir=str(tmp_path))
        with pytest.raises(ValueError, match=r"offload_overlap='delayed' with offload_params='cpu'"):
            front_door(stage=3, **delayed, offload_params="cpu")
        with pytest.raises(ValueError, match=r"async_save=True with state_dict_type='full'"):
            front_door(stage=2, async_save=True, state_dict_type="full")
    with pytest.raises(NotImplementedError, match=r"does not take auto=True .* computes its loss in its own code"):
        ZeroFabricStrategy(auto=True)
