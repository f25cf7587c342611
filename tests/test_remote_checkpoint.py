"""Sharded checkpoints on fsspec URLs: ``memory://`` in one process (save through ``default_root_dir``, resume exactly,
consolidate, a failing save) and ``s3://`` on a local S3-compatible server at world size 2 (``ModelCheckpoint(dirpath)``
and ``trainer.save_checkpoint``, exact resume at stages 2 and 3, a rank killed mid-save), plus the commit's checks
without a process group (Note [commit on an object store]).
"""

from __future__ import annotations

import io
import os
import re
import signal
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any

import fsspec
import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor

from lightning_zero.__main__ import main as cli
from lightning_zero.checkpoint.files import CheckpointError
from lightning_zero.checkpoint.storage import ChecksummingWriter
from tests.harness import DistributedTestError, run_distributed
from tests.test_checkpoint_files import _load, _mlp, _save
from tests.test_checkpoint_trainer import SAMPLES, Snapshot, TinyGPT, assert_same, weights, zero

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class LossGPT(TinyGPT):
    """TinyGPT that records its loss at every training step."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        self.losses.append(float(loss))
        return loss


def _fit(stage: int, devices: int, steps: int, root: str, ckpt: str | None = None, callbacks: Any = ()) -> LossGPT:
    module = LossGPT()
    trainer = pl.Trainer(
        strategy=zero(stage),
        accelerator="cpu",
        devices=devices,
        max_steps=steps,
        callbacks=list(callbacks),
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, ckpt_path=ckpt)
    return module


def _names(fs: fsspec.AbstractFileSystem, path: str) -> list[str]:
    fs.invalidate_cache(path)
    return sorted(str(p).rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))


def _read(url: str) -> dict[str, Any]:
    fs, path = fsspec.core.url_to_fs(url)
    return torch.load(io.BytesIO(fs.cat_file(path)), weights_only=True)


# -- memory:// in one process ----------------------------------------------------------------------------------------
STEPS, SAVE_AT = 10, 4  # mid-epoch: 16 batches per epoch at world size 1


def _memory_round_trip(stage: int) -> dict[str, Any]:
    root = f"memory://run-{uuid.uuid4().hex[:8]}"  # ModelCheckpoint without dirpath saves under default_root_dir
    at_save = Snapshot(at="save")
    saves = ModelCheckpoint(every_n_train_steps=SAVE_AT, save_top_k=-1)
    best = ModelCheckpoint(dirpath=f"{root}/best", monitor="step", mode="max", save_top_k=1, every_n_train_steps=5)
    uninterrupted = _fit(stage, 1, STEPS, root, callbacks=[at_save, saves, best])
    ckpt = f"{root}/checkpoints/epoch=0-step={SAVE_AT}.ckpt"
    resumed = _fit(stage, 1, STEPS, root, ckpt=ckpt)
    assert cli(["consolidate", ckpt, f"{root}/plain.ckpt"]) == 0
    assert at_save.taken is not None
    fs = fsspec.filesystem("memory")
    return {
        "listing": _names(fs, root.removeprefix("memory://") + "/checkpoints"),
        "best": _names(fs, root.removeprefix("memory://") + "/best"),
        "inside": _names(fs, ckpt.removeprefix("memory://")),
        "uninterrupted": (uninterrupted.losses, weights(uninterrupted)),
        "resumed": (resumed.losses, weights(resumed)),
        "at_save": at_save.taken["weights"],
        "plain": _read(f"{root}/plain.ckpt"),
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "stage",
    [2, pytest.param(3, marks=pytest.mark.slow)],  # 5 s; [2] and the S3 test's stage 3 run by default
)
def test_memory_url_saves_resumes_exactly_and_consolidates(stage):
    (result,) = run_distributed(_memory_round_trip, 1, stage, init_process_group=False)
    assert result["listing"] == ["epoch=0-step=4.ckpt", "epoch=0-step=8.ckpt"]
    assert result["best"] == ["epoch=0-step=10.ckpt"]  # top-1: the save of step 5 was removed
    assert result["inside"][-1] == "lightning_state.pt"
    assert len(result["inside"]) == 2
    assert result["inside"][0].startswith("data-")
    losses, final = result["uninterrupted"]
    resumed_losses, resumed_final = result["resumed"]
    assert len(losses) == STEPS
    assert resumed_losses == losses[SAVE_AT:]  # every step after the resume, bit for bit
    assert_same(resumed_final, final)
    plain = result["plain"]
    assert plain["global_step"] == SAVE_AT
    assert_same(plain["state_dict"], result["at_save"])


def _fail_in_second_save(root: str) -> dict[str, Any]:
    write_data = ChecksummingWriter.write_data
    calls: list[list[str]] = []
    fs = fsspec.filesystem("memory")
    last = f"{root}/ck/last.ckpt"

    def write_then_fail(self: ChecksummingWriter, *args: Any, **kwargs: Any) -> Any:
        future = write_data(self, *args, **kwargs)  # the new files are written, nothing is committed
        calls.append(_names(fs, last.removeprefix("memory://")))
        if len(calls) == 2:
            raise OSError("injected: the object store went away")
        return future

    ChecksummingWriter.write_data = write_then_fail  # type: ignore[method-assign]
    keep_last = ModelCheckpoint(dirpath=f"{root}/ck", every_n_train_steps=2, save_top_k=0, save_last=True)
    failed = "the save did not fail"
    try:
        _fit(2, 1, 4, root, callbacks=[keep_last])
    except CheckpointError as error:
        failed = str(error)
    finally:
        ChecksummingWriter.write_data = write_data  # type: ignore[method-assign]
    after_failure = _names(fs, last.removeprefix("memory://"))
    start = Snapshot(at="start")
    _fit(2, 1, 6, root, ckpt=last, callbacks=[start])
    assert start.taken is not None
    return {"failed": failed, "during": calls[1], "after": after_failure, "resumed_at": start.taken["step"]}


@pytest.mark.timeout(90)
def test_failed_save_on_memory_url_leaves_the_previous_checkpoint_loadable():
    (result,) = run_distributed(_fail_in_second_save, 1, "memory://crash", init_process_group=False)
    assert re.search(r"Saving checkpoint memory://crash/ck/last.ckpt failed: OSError: injected", result["failed"])
    # While the second save wrote its files, the first one's were still there, untouched and committed.
    assert [n.startswith("data-") for n in result["during"]] == [True, True, False]
    assert result["during"][-1] == "lightning_state.pt"
    assert len(result["after"]) == 2  # the failed save's files are gone; the committed checkpoint is whole
    assert result["after"][0] in result["during"]
    assert result["resumed_at"] == 2


# -- the commit's checks, without a process group --------------------------------------------------------------------
def test_remote_directory_without_its_commit_is_refused():
    url = f"memory://uncommitted-{uuid.uuid4().hex[:8]}/a.ckpt"
    _save(_mlp(), url)
    fs, path = fsspec.core.url_to_fs(url)
    fs.rm_file(f"{path}/lightning_state.pt")  # what a crash before the commit leaves: data, no lightning_state.pt
    with pytest.raises(CheckpointError, match=r"has no lightning_state.pt, so it is not a checkpoint"):
        _load(_mlp(), url)
    with pytest.raises(CheckpointError, match=r"does not exist"):
        _load(_mlp(), url + "-never-saved")


def test_file_url_is_a_local_path_with_the_rename_commit(tmp_path):
    url = f"file://{tmp_path}/a.ckpt"
    saved = _mlp()
    _save(saved, url)
    assert sorted(os.listdir(tmp_path / "a.ckpt")) == [".metadata", "__0_0.distcp", "lightning_state.pt"]
    loaded = _mlp()
    with torch.no_grad():
        for p in loaded.parameters():
            p.zero_()
    _load(loaded, url)
    assert_same(dict(loaded.state_dict()), dict(saved.state_dict()))


def test_unknown_protocol_names_the_path_and_the_fix():
    with pytest.raises(ValueError, match=r"Invalid checkpoint path: 'nosuchfs://bucket/a.ckpt'.*HINT: install"):
        _load(_mlp(), "nosuchfs://bucket/a.ckpt")


def test_corrupted_remote_shard_file_is_refused_by_its_checksum():
    url = f"memory://corrupt-{uuid.uuid4().hex[:8]}/a.ckpt"
    _save(_mlp(), url)
    fs, path = fsspec.core.url_to_fs(url)
    (shard,) = [p for p in fs.find(path) if p.endswith(".distcp")]
    data = bytearray(fs.cat_file(shard))
    data[-100] ^= 0xFF  # inside the last tensor's bytes, same length: only the CRC can tell
    fs.pipe_file(shard, bytes(data))
    with pytest.raises(CheckpointError, match=r"is corrupted: its CRC-32"):
        _load(_mlp(), url)


def test_saving_again_replaces_the_remote_checkpoint_and_removes_the_previous_data():
    url = f"memory://again-{uuid.uuid4().hex[:8]}/a.ckpt"
    fs, path = fsspec.core.url_to_fs(url)
    _save(_mlp(), url)
    (first,) = [n for n in _names(fs, path) if n.startswith("data-")]
    fs.makedirs(f"{path}/data-000000000000")  # what an interrupted save left
    fs.pipe_file(f"{path}/data-000000000000/__0_0.distcp", b"partial")
    fs.pipe_file(f"{path}/notes.txt", b"not the checkpoint's: left alone")
    other = _mlp(hidden=16)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    _save(other, url)
    listing = _names(fs, path)
    assert len(listing) == 3
    assert listing[0] not in (first, "data-000000000000")
    assert listing[0].startswith("data-")
    assert listing[1:] == ["lightning_state.pt", "notes.txt"]
    loaded = _mlp()
    _load(loaded, url)
    assert_same(dict(loaded.state_dict()), dict(other.state_dict()))


# -- s3:// on a local server, world size 2 ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def s3_bucket() -> Iterator[str]:
    """A bucket on a moto S3 server on localhost; ranks reach it through the standard AWS environment variables."""
    moto_server = pytest.importorskip("moto.moto_server.threaded_moto_server", reason="needs moto[server] (dev extra)")
    pytest.importorskip("s3fs", reason="needs s3fs (dev extra)")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        bucket = f"ckpt-{uuid.uuid4().hex[:8]}"
        fsspec.filesystem("s3", skip_instance_cache=True).mkdir(bucket)
        yield bucket
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.stop()


class SaveAt(pl.Callback):
    """``trainer.save_checkpoint(path)`` after optimizer step ``step``."""

    def __init__(self, step: int, path: str) -> None:
        self.step = step
        self.path = path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def _s3_resume(root: str, stage: int) -> dict[str, Any]:
    per_epoch = SAMPLES // (4 * 2)  # batches per epoch per rank at world size 2
    steps, mid = per_epoch + 2, per_epoch // 2
    saves = ModelCheckpoint(dirpath=f"{root}/ck", every_n_train_steps=mid, save_top_k=-1)
    explicit = SaveAt(mid + 1, f"{root}/explicit.ckpt")
    uninterrupted = _fit(stage, 2, steps, root, callbacks=[saves, explicit])
    resumed = _fit(stage, 2, steps, root, ckpt=f"{root}/ck/epoch=0-step={mid}.ckpt")
    from_explicit = _fit(stage, 2, steps, root, ckpt=f"{root}/explicit.ckpt")
    dist.barrier()
    return {
        "mid": mid,
        "uninterrupted": (uninterrupted.losses, weights(uninterrupted)),
        "resumed": (resumed.losses, weights(resumed)),
        "from_explicit": (from_explicit.losses, weights(from_explicit)),
    }


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "stage",
    [pytest.param(2, marks=pytest.mark.slow), 3],  # 3 s; [3] and the memory:// test's stage 2 run by default
)
def test_s3_checkpoints_resume_exactly_at_world_size_2_and_consolidate(s3_bucket, stage, tmp_path):
    root = f"s3://{s3_bucket}/resume-{stage}"
    results = run_distributed(_s3_resume, 2, root, stage, init_process_group=False, timeout=230)
    for rank in results:  # each rank against the same rank of the uninterrupted run: its own batches
        mid = rank["mid"]
        losses, final = rank["uninterrupted"]
        for name, start in (("resumed", mid), ("from_explicit", mid + 1)):
            resumed_losses, resumed_final = rank[name]
            assert resumed_losses == losses[start:], name
            assert_same(resumed_final, final)
    out = tmp_path / "plain.ckpt"
    assert cli(["consolidate", f"{root}/ck/epoch=0-step={results[0]['mid']}.ckpt", str(out)]) == 0
    assert torch.load(out, weights_only=True)["global_step"] == results[0]["mid"]


def _killed_in_second_save(root: str) -> None:
    write_data = ChecksummingWriter.write_data
    calls = []

    def write_then_die(self: ChecksummingWriter, *args: Any, **kwargs: Any) -> Any:
        future = write_data(self, *args, **kwargs)  # this rank's shard file is uploaded, nothing is committed
        calls.append(1)
        if len(calls) == 2 and dist.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        return future

    ChecksummingWriter.write_data = write_then_die  # type: ignore[method-assign]
    keep_last = ModelCheckpoint(dirpath=f"{root}/ck", every_n_train_steps=2, save_top_k=0, save_last=True)
    _fit(2, 2, 4, root, callbacks=[keep_last])


def _resume_from(ckpt: str) -> int:
    start = Snapshot(at="start")
    _fit(2, 2, 4, tempfile.gettempdir(), ckpt=ckpt, callbacks=[start, SaveAt(3, ckpt)])
    assert start.taken is not None
    return start.taken["step"]


@pytest.mark.timeout(180)
def test_rank_killed_mid_save_on_s3_leaves_the_previous_checkpoint_loadable(s3_bucket):
    root = f"s3://{s3_bucket}/crash"
    last = f"{root}/ck/last.ckpt"
    with pytest.raises(DistributedTestError, match="rank 0") as crash:
        run_distributed(_killed_in_second_save, 2, root, init_process_group=False, timeout=90)
    assert "SIGKILL" in crash.value.failures[0]
    fs, path = fsspec.core.url_to_fs(last)
    listing = _names(fs, path)
    assert [n.startswith("data-") for n in listing] == [True, True, False]  # the committed save and the partial one
    assert run_distributed(_resume_from, 2, last, init_process_group=False) == [2, 2]
    assert len(_names(fs, path)) == 2  # the next save of the name removed the partial data
