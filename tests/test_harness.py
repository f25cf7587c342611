"""Tests for the multi-process harness itself: results, failures, hangs, crashes, env-only mode, no leftovers."""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import signal
import time
from collections.abc import Iterator

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from tests.harness import DistributedTestError, run_distributed

_ENV_KEYS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE")


# ---- functions run inside the ranks (module level, so they pickle by reference) ----


def _rank_info() -> tuple[int, int, int, int]:
    total = torch.tensor([dist.get_rank()])
    dist.all_reduce(total)
    return dist.get_rank(), dist.get_world_size(), int(total.item()), torch.get_num_threads()


def _raise_on_rank1(rank0_waits_in: str) -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    if rank0_waits_in == "all_reduce":
        dist.all_reduce(torch.ones(1))  # gloo notices the peer is gone and fails this rank too
    else:
        # A store wait does not notice (the store lives in the parent): the harness must kill this rank.
        dist.distributed_c10d._get_default_store().wait(["never-set"])


def _hang_on_rank1() -> int:
    if dist.get_rank() == 1:
        time.sleep(3600)
    return dist.get_rank()


def _die_on_rank1(how: str) -> None:
    if dist.get_rank() == 1:
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def _report_env() -> tuple[dict[str, str | None], bool]:
    return {k: os.environ.get(k) for k in (*_ENV_KEYS, "EXTRA_VAR", "PARENT_VAR")}, dist.is_initialized()


def _init_group_via_env() -> int:
    dist.init_process_group("gloo")  # env:// -- what a Lightning Trainer does for an externally launched job
    total = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(total)
    return int(total.item())


class _TinyModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss: torch.Tensor = self.layer(batch[0]).sum()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_with_lightning() -> tuple[int, int, str]:
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(_TinyModule(), DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4))
    assert isinstance(trainer.strategy, pl.strategies.DDPStrategy)
    return trainer.global_rank, trainer.world_size, type(trainer.strategy.cluster_environment).__name__


# ---- leftover-process check ----


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # not a pid, or it exited while we looked
        children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


@pytest.fixture(autouse=True)
def _no_leftover_processes() -> Iterator[None]:
    yield
    assert multiprocessing.active_children() == []
    # The forkserver and resource tracker are long-lived helpers by design; any rank (a forkserver child) is not.
    helpers = {
        multiprocessing.forkserver._forkserver._forkserver_pid,  # type: ignore[attr-defined]
        multiprocessing.resource_tracker._resource_tracker._pid,  # type: ignore[attr-defined]
    }
    assert _descendants(os.getpid()) - helpers == set()


# ---- tests ----


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_returns_results_in_rank_order(world_size: int) -> None:
    results = run_distributed(_rank_info, world_size)
    expected_sum = world_size * (world_size - 1) // 2
    threads = max(1, (os.cpu_count() or 1) // world_size)
    assert results == [(rank, world_size, expected_sum, threads) for rank in range(world_size)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rank0_waits_in", ["all_reduce", "store"])
def test_exception_on_one_rank_is_reported_fast(rank0_waits_in: str) -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as excinfo:
        # A generous collective timeout: rank 0 must be killed (or fail on its own), not wait for this.
        run_distributed(_raise_on_rank1, 2, rank0_waits_in, collective_timeout=60)
    assert time.monotonic() - start < 20
    failures = excinfo.value.failures
    assert "rank 1" in str(excinfo.value)
    assert "ValueError: boom on rank 1" in failures[1]
    assert "_raise_on_rank1" in failures[1]  # the real traceback, not just the message
    assert 0 in failures  # rank 0 is reported too: either its own gloo error or that it was killed
    if rank0_waits_in == "store":
        assert "after rank(s) 1 failed; killed" in failures[0]


@pytest.mark.slow  # 6.5 s; every collective-timeout test of the suite relies on the same kill
@pytest.mark.timeout(60)
def test_hung_rank_is_killed_at_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as excinfo:
        run_distributed(_hang_on_rank1, 2, timeout=6)
    assert 6 <= time.monotonic() - start < 20
    assert list(excinfo.value.failures) == [1]
    assert "did not finish within timeout=6 s" in excinfo.value.failures[1]
    assert "_hang_on_rank1" in excinfo.value.failures[1]  # the faulthandler dump shows where it hung


@pytest.mark.timeout(60)
def test_a_rank_killed_before_it_started_is_reported_as_not_finished() -> None:
    # A timeout shorter than a rank's start: it is killed before it opens its stack-dump file.
    with pytest.raises(DistributedTestError) as excinfo:
        run_distributed(_rank_info, 1, timeout=0.001)
    assert "did not finish within timeout" in excinfo.value.failures[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("how", "expected"), [("exit", "exited with code 3"), ("kill", "signal SIGKILL")])
def test_rank_dying_without_reporting(how: str, expected: str) -> None:
    with pytest.raises(DistributedTestError) as excinfo:
        run_distributed(_die_on_rank1, 2, how, collective_timeout=60)
    assert "rank 1" in str(excinfo.value)
    assert expected in excinfo.value.failures[1]


@pytest.mark.timeout(60)
def test_env_only_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    # Set after the forkserver may already be running: ranks must still see the caller's current environment.
    monkeypatch.setenv("PARENT_VAR", "from-parent")
    results = run_distributed(_report_env, 2, init_process_group=False, env={"EXTRA_VAR": "extra"})
    ports = {env["MASTER_PORT"] for env, _ in results}
    assert len(ports) == 1
    for rank, (env, initialized) in enumerate(results):
        assert not initialized
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert (env["RANK"], env["LOCAL_RANK"], env["NODE_RANK"]) == (str(rank), str(rank), "0")
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert (env["EXTRA_VAR"], env["PARENT_VAR"]) == ("extra", "from-parent")


@pytest.mark.timeout(60)
def test_env_only_mode_lets_the_child_create_the_group() -> None:
    assert run_distributed(_init_group_via_env, 2, init_process_group=False) == [3, 3]


@pytest.mark.timeout(60)
def test_env_only_mode_runs_a_lightning_trainer() -> None:
    # Lightning sees LOCAL_RANK, treats the job as externally launched and creates the group itself (no re-launch).
    results = run_distributed(_fit_with_lightning, 2, init_process_group=False)
    assert results == [(0, 2, "LightningEnvironment"), (1, 2, "LightningEnvironment")]
