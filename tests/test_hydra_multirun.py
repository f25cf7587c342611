"""``examples/train.py -m ...``: a Hydra sweep whose every job launches its own two processes in its own directory.

See Note [Hydra multirun and Lightning's relaunch] in ``lightning_zero/hydra/launch.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch.distributed as dist
import yaml
from lightning.fabric.plugins.environments import LightningEnvironment

from lightning_zero.hydra.launch import HydraJob, JobLauncher, job_overrides
from tests.test_example import FAST, losses, read_report, run_example

SWEEP_HYDRA = ["hydra.job.chdir=False", "hydra.mode=MULTIRUN", "hydra.sweep.dir=/s", "hydra/launcher=basic"]


def test_child_reruns_only_its_own_job_as_a_single_run():
    args = job_overrides(
        argv=["-m", "--config-name=config", "-cd", "extra", "strategy=zero1,zero2", "seed=1"],
        task_overrides=["strategy=zero2", "seed=1"],
        hydra_overrides=SWEEP_HYDRA,
        output_dir="/runs/multirun/2026-01-01/12-00-00/1",
        job_name="train",
        local_rank=1,
    )
    assert args == [
        "--config-name=config",
        "--config-dir=extra",
        "strategy=zero2",
        "seed=1",
        "hydra.job.chdir=False",
        "hydra.mode=RUN",
        'hydra.run.dir="/runs/multirun/2026-01-01/12-00-00/1"',
        "hydra.job.name=train_rank1",
        "hydra.output_subdir=null",
    ]


def test_child_of_a_single_run_gets_the_same_overrides():
    args = job_overrides(["trainer.max_steps=5"], ["trainer.max_steps=5"], ["hydra.mode=RUN"], "/out", "train", 3)
    assert args[:2] == ["trainer.max_steps=5", "hydra.mode=RUN"]
    assert 'hydra.run.dir="/out"' in args
    assert "hydra.job.name=train_rank3" in args


def test_quoted_run_dir_survives_special_characters():
    args = job_overrides([], [], [], '/tmp/a b,c=d"e', "train", 1)
    assert 'hydra.run.dir="/tmp/a b,c=d\\"e"' in args


@pytest.mark.timeout(150)
def test_multirun_runs_each_strategy_as_its_own_two_process_job(tmp_path):
    sweep = tmp_path / "sweep"
    output = run_example(["-m", "strategy=zero1,zero2", *FAST, f"hydra.sweep.dir={sweep}"], cwd=tmp_path, timeout=140)

    # One sweep, launched once: a child that re-ran the sweep would launch it again.
    assert output.count("Launching 2 jobs locally") == 1, output
    assert sorted(p.name for p in sweep.iterdir()) == ["0", "1", "multirun.yaml"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep"]  # no stray outputs/ or multirun/ of a child
    assert len(losses(output)) == 2 * 4
    for job, stage in (("0", 1), ("1", 2)):
        job_dir = sweep / job
        overrides = yaml.safe_load((job_dir / ".hydra" / "overrides.yaml").read_text())
        assert f"strategy=zero{stage}" in overrides
        report = read_report(job_dir)
        assert report["stage"] == stage
        assert report["world_size"] == 2
        assert len(report["ranks"]) == 2
        # The launched rank ran this job, in this job's directory.
        assert (job_dir / "train_rank1.log").is_file()


def test_hydra_job_undoes_what_a_job_leaves_in_the_process(tmp_path, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    with HydraJob():
        os.environ["LOCAL_RANK"] = "0"  # as Lightning's launcher leaves it
        os.environ["MASTER_PORT"] = "12345"
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    assert "LOCAL_RANK" not in os.environ
    assert "MASTER_PORT" not in os.environ
    assert not dist.is_initialized()


def test_hydra_job_reports_a_launched_rank_that_failed():
    job = HydraJob(child_timeout=30)
    launcher = JobLauncher(LightningEnvironment(), num_processes=2, num_nodes=1)
    launcher.procs = [subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])]
    job._launchers.append(launcher)
    with pytest.raises(RuntimeError, match=r"local rank 1 \(pid \d+\) exited with code 3.*HINT"), job:
        pass
