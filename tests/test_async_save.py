"""``ZeroConfig.async_save``: sharded saves written in the background while training goes on, with the synchronous
save's commit protocol, exact resume and fault guarantees (Note [asynchronous save])."""

from __future__ import annotations

import dataclasses
import os
import signal
import tempfile
import threading
from typing import Any

import lightning.pytorch as pl
import pytest
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint import FileSystemWriter

from lightning_zero import ZeroConfig, ZeroStrategy
from lightning_zero.checkpoint.files import read_metadata
from lightning_zero.checkpoint.storage import locate
from tests.harness import DistributedTestError, run_distributed
from tests.test_checkpoint_trainer import BATCH, SAMPLES, Snapshot, assert_same, fit, weights


def _async(stage: int) -> ZeroStrategy:
    return ZeroStrategy(stage=stage, bucket_numel=3_000, async_save=True)


def _resume_exactly(root: str, stage: int) -> list[dict[str, Any]]:
    per_epoch = SAMPLES // (BATCH * 2)
    saves = ModelCheckpoint(dirpath=f"{root}/ck", every_n_train_steps=per_epoch // 2, save_top_k=-1)
    uninterrupted = weights(fit(_async(stage), 2, per_epoch + 2, root, callbacks=[saves]))
    ckpt = f"{root}/ck/epoch=0-step={per_epoch // 2}.ckpt"
    resumed = weights(fit(_async(stage), 2, per_epoch + 2, root, ckpt=ckpt))
    return [uninterrupted, resumed]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("stage", [2, 3])
def test_a_run_resumed_from_an_async_save_is_bit_identical_to_the_uninterrupted_one(stage):
    with tempfile.TemporaryDirectory() as root:
        for uninterrupted, resumed in run_distributed(_resume_exactly, 2, root, stage, init_process_group=False):
            assert_same(resumed, uninterrupted)


def _die_in_the_second_async_write(root: str) -> None:
    write_data = FileSystemWriter.write_data
    calls = []

    def write_then_die(self: FileSystemWriter, *args: Any, **kwargs: Any) -> Any:
        future = write_data(self, *args, **kwargs)  # this rank's shard file is on disk, nothing is committed
        calls.append(threading.current_thread().name)
        if len(calls) == 2 and dist.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGKILL)  # from the writer's thread, while training goes on
        return future

    FileSystemWriter.write_data = write_then_die  # type: ignore[method-assign]
    # save_top_k=1: the checkpoint of step 2 is to be removed once step 4's is saved, and must outlive the crash.
    fit(_async(2), 2, 6, root, callbacks=[ModelCheckpoint(dirpath=f"{root}/ck", every_n_train_steps=2, save_top_k=1)])


def _resume_from(root: str, ckpt: str) -> int:
    start = Snapshot(at="start")
    fit(_async(2), 2, 4, root, ckpt=ckpt, callbacks=[start])
    assert start.taken is not None
    return int(start.taken["step"])


@pytest.mark.timeout(150)
def test_a_rank_killed_during_an_async_write_loses_nothing_already_committed():
    with tempfile.TemporaryDirectory() as root:
        with pytest.raises(DistributedTestError, match="rank 0") as crash:
            run_distributed(_die_in_the_second_async_write, 2, root, init_process_group=False, timeout=90)
        assert "SIGKILL" in crash.value.failures[0]
        listing = sorted(os.listdir(f"{root}/ck"))
        # Step 2's checkpoint was committed; its removal waited for step 4's commit, which never came.
        assert "epoch=0-step=2.ckpt" in listing, listing
        assert "epoch=0-step=4.ckpt" not in listing, listing
        assert run_distributed(_resume_from, 2, root, f"{root}/ck/epoch=0-step=2.ckpt", init_process_group=False) == [
            2,
            2,
        ]


def test_async_save_is_refused_where_it_cannot_snapshot():
    with pytest.raises(ValueError, match=r"async_save=True with state_dict_type='full'"):
        ZeroConfig(async_save=True, state_dict_type="full")
    with pytest.raises(ValueError, match=r"async_save=True with a disk tier"):
        ZeroConfig(stage=3, async_save=True, offload_optimizer="disk", offload_dir="/tmp")


def _writer_processes() -> list[str]:
    """This process's children running the checkpoint writer."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as stat, open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
                command = cmdline.read().decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        if parent == os.getpid() and "write_worker.py" in command:
            found.append(pid)
    return found


class _SaveBothWays(pl.Callback):
    """At step 2: an asynchronous save, then a synchronous one of the same state."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.writers: list[str] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step != 2:
            return
        strategy = trainer.strategy
        assert isinstance(strategy, ZeroStrategy)
        trainer.save_checkpoint(f"{self.root}/async.ckpt")
        assert strategy.async_saver is not None
        strategy.async_saver.wait()
        self.writers = _writer_processes()
        config, strategy.config = strategy.config, dataclasses.replace(strategy.config, async_save=False)
        trainer.save_checkpoint(f"{self.root}/sync.ckpt")
        strategy.config = config


def _save_both_ways(root: str) -> list[str]:
    saves = _SaveBothWays(root)
    fit(_async(3), 2, 3, root, callbacks=[saves])
    return saves.writers


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="the writer process needs memfd_create (Linux)")
@pytest.mark.timeout(120)
def test_the_writer_process_writes_the_files_a_synchronous_save_writes():
    with tempfile.TemporaryDirectory() as root:
        writers = run_distributed(_save_both_ways, 2, root, init_process_group=False)
        assert all(len(w) == 1 for w in writers), writers  # one writer process per rank wrote the async save
        names = sorted(os.listdir(f"{root}/sync.ckpt"))
        assert sorted(os.listdir(f"{root}/async.ckpt")) == names
        assert sum(name.endswith(".distcp") for name in names) == 2, names
        # DCP's metadata differs in its save's id and path: compare where each record lies and what it holds.
        async_metadata, sync_metadata = (read_metadata(locate(f"{root}/{kind}.ckpt")) for kind in ("async", "sync"))
        assert async_metadata.storage_data == sync_metadata.storage_data
        assert async_metadata.state_dict_metadata == sync_metadata.state_dict_metadata
        for name in set(names) - {".metadata"}:  # the shard files, the table of contents with their checksums
            with open(f"{root}/async.ckpt/{name}", "rb") as a, open(f"{root}/sync.ckpt/{name}", "rb") as s:
                assert a.read() == s.read(), name


class _KillWriter(pl.Callback):
    """Kills rank 0's writer process after step 3, once the save of step 2 is committed."""

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == 3:
            strategy = trainer.strategy
            assert isinstance(strategy, ZeroStrategy)
            assert strategy.async_saver is not None
            strategy.async_saver.wait()  # step 2's save is committed
            if trainer.global_rank == 0:
                (pid,) = _writer_processes()
                os.kill(int(pid), signal.SIGKILL)


def _lose_the_writer(root: str) -> None:
    saves = ModelCheckpoint(dirpath=f"{root}/ck", every_n_train_steps=2, save_top_k=-1)
    fit(_async(2), 2, 6, root, callbacks=[saves, _KillWriter()])


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="the writer process needs memfd_create (Linux)")
@pytest.mark.timeout(120)
def test_a_lost_writer_process_fails_the_save_on_every_rank_and_commits_nothing():
    with tempfile.TemporaryDirectory() as root:
        with pytest.raises(DistributedTestError) as failed:
            run_distributed(_lose_the_writer, 2, root, init_process_group=False, timeout=90, grace=30)
        assert sorted(failed.value.failures) == [0, 1]
        assert all("Saving checkpoint" in failure for failure in failed.value.failures.values()), failed.value.failures
        assert "writer process exited" in failed.value.failures[0]
        assert sorted(os.listdir(f"{root}/ck")) == ["epoch=0-step=2.ckpt"]
