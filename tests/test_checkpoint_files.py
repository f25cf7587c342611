"""Sharded checkpoint files without a process group: the owned-slice layout, safety against pickled payloads, clear
errors for damaged or mismatched checkpoints, and the atomic commit (training-level behaviour: test_checkpoint_trainer).
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import os
import pickle
import re
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from lightning_zero.checkpoint import local_commit, sharded_checkpoint
from lightning_zero.checkpoint.files import (
    DCP_METADATA_FILE,
    LIGHTNING_STATE_FILE,
    CheckpointError,
    remove,
    stage_save,
)
from lightning_zero.checkpoint.format import SafeLoadPlanner
from lightning_zero.checkpoint.full_weights import load_full_state_dict
from lightning_zero.checkpoint.local_commit import commit, recover_interrupted_commits
from lightning_zero.checkpoint.sharded_checkpoint import (
    load_checkpoint,
    owned_parameter_slices,
    save_sharded_checkpoint,
    sharded_model_state,
)
from lightning_zero.checkpoint.storage import locate
from lightning_zero.cli.consolidate import consolidate_checkpoint
from lightning_zero.models.mlp import MLP
from lightning_zero.sharding.flat_bucket import build_buckets
from lightning_zero.sharding.param_groups import Segment

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class Payload:
    """Unpickling this creates ``marker``: the stand-in for code a malicious checkpoint would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@dataclasses.dataclass
class Settings:
    """A user's class in a checkpoint: loads only once allow-listed."""

    size: int


def _mlp(hidden: int = 16) -> MLP:
    torch.manual_seed(0)
    return MLP(in_features=6, hidden=(hidden,), out_features=3)


def _save(module: nn.Module, path: Path) -> Path:
    checkpoint = {"epoch": 1, "global_step": 7, "state_dict": sharded_model_state(module, [])}
    save_sharded_checkpoint(checkpoint, path, None, {"world_size": 1, "stage": 2})
    return path


def _load(module: nn.Module, path: Path) -> dict:
    return load_checkpoint(path, module, [], None, load_optimizer=False)


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    return _save(_mlp(), tmp_path / "epoch=1-step=7.ckpt")


# -- layout ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_owned_slices_of_all_ranks_tile_every_parameter_exactly(world_size):
    model = _mlp(hidden=5)  # small, odd sizes: parameters straddle ranks and buckets end in padding
    expected = {n: p.detach().clone().reshape(-1) for n, p in model.named_parameters()}
    covered: dict[str, list[tuple[int, int]]] = {n: [] for n in expected}
    for rank in range(world_size):
        buckets = build_buckets([list(model.named_parameters())], 40, rank, world_size, list(model.parameters()))
        segments = [Segment(b, 0, min(b.shard_numel, b.numel - rank * b.shard_numel), 0) for b in buckets]
        segments = [s for s in segments if s.stop > 0]
        masters = [s.bucket.param_shard[s.start : s.stop] for s in segments]  # fp32: the parameters themselves
        fake = SimpleNamespace(buckets=buckets, segments=segments, masters=masters, gatherer=None)
        for s in owned_parameter_slices([fake]):
            if s.stop > s.start:
                covered[s.fqn].append((s.start, s.stop))
                torch.testing.assert_close(s.values, expected[s.fqn][s.start : s.stop], rtol=0, atol=0)
                assert s.optimizer == 0
                assert s.master is not None
                assert s.master.data_ptr() == s.values.data_ptr()
    for name, ranges in covered.items():
        ranges.sort()
        assert (ranges[0][0], ranges[-1][1]) == (0, expected[name].numel()), name
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges)), f"{name}: gaps or overlaps {ranges}"


# -- round trip without a process group ------------------------------------------------------------------------------
def test_round_trip_consolidate_and_pretrained_weights_in_one_process(saved, tmp_path):
    source = dict(_mlp().state_dict())
    target = _mlp(hidden=16)
    with torch.no_grad():
        for p in target.parameters():
            p.zero_()
    state = _load(target, saved)
    assert state["global_step"] == 7
    assert "state_dict" not in state
    for name, value in target.state_dict().items():
        assert torch.equal(value, source[name]), name

    out = consolidate_checkpoint(saved, tmp_path / "plain.ckpt")
    plain = torch.load(out, weights_only=True)
    assert plain["global_step"] == 7
    assert {k: torch.equal(v, source[k]) for k, v in plain["state_dict"].items()} == dict.fromkeys(source, True)

    wrapper = nn.Module()
    wrapper.inner = _mlp()
    with torch.no_grad():
        for p in wrapper.parameters():
            p.zero_()
    torch.save(source, tmp_path / "pretrained.pt")
    load_full_state_dict(wrapper, tmp_path / "pretrained.pt", prefix="inner.")
    for name, value in wrapper.inner.state_dict().items():
        assert torch.equal(value, source[name]), name


# -- nothing in a checkpoint can run code -----------------------------------------------------------------------------
def _assert_payload_is_live(marker: Path) -> None:
    pickle.loads(pickle.dumps(Payload(marker)))  # unpickled unsafely, the payload does create the file...
    assert marker.exists()
    marker.unlink()


def test_pickled_payload_in_lightning_state_is_refused(saved, tmp_path):
    marker = tmp_path / "pwned"
    _assert_payload_is_live(marker)
    torch.save({"epoch": 1, "callbacks": {"x": Payload(marker)}}, saved / LIGHTNING_STATE_FILE)
    with pytest.raises(CheckpointError, match=re.escape(str(saved / LIGHTNING_STATE_FILE))):
        _load(_mlp(), saved)
    with pytest.raises(CheckpointError, match="Refused to load"):
        consolidate_checkpoint(saved, tmp_path / "out.ckpt")
    assert not marker.exists()


@pytest.mark.parametrize(
    ("entry", "named"),
    [(torch.utils.data.DataLoader(torch.arange(4)), "'loader' (a DataLoader)"), (lambda: 0, "'loader' (a function)")],
)
def test_a_state_that_would_not_load_back_is_refused_before_anything_is_written(entry, named, tmp_path):
    """Note [a save that cannot load back]: a plain DataLoader pickles and then fails every weights_only load; a
    lambda does not pickle at all. Both are refused by name before a file is written, and the previous checkpoint of
    that name is left as it was; a class allow-listed where it is saved and loaded is saved and loads back."""
    path = _save(_mlp(), tmp_path / "last.ckpt")
    before = sorted(p.name for p in path.iterdir())
    checkpoint = {"epoch": 2, "loader": entry, "state_dict": sharded_model_state(_mlp(), [])}
    with pytest.raises(CheckpointError, match=re.escape(named) + ".*weights_only=True.*HINT: ") as refused:
        save_sharded_checkpoint(checkpoint, path, None, {"world_size": 1, "stage": 2})
    assert "Nothing was written" in str(refused.value)
    assert sorted(p.name for p in path.iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no staged directory left
    assert _load(_mlp(), path)["epoch"] == 1
    checkpoint = {"epoch": 2, "loader": Settings(3), "state_dict": sharded_model_state(_mlp(), [])}
    with torch.serialization.safe_globals([Settings]):
        save_sharded_checkpoint(checkpoint, path, None, {"world_size": 1, "stage": 2})
        loaded = _load(_mlp(), path)
    assert (loaded["epoch"], loaded["loader"]) == (2, Settings(3))


@pytest.mark.parametrize("where", ["whole file", "inside valid metadata"])
def test_pickled_payload_in_dcp_metadata_is_refused(saved, tmp_path, where):
    marker = tmp_path / "pwned"
    _assert_payload_is_live(marker)
    if where == "whole file":
        payload = pickle.dumps(Payload(marker))
    else:  # a genuine Metadata object carrying the payload in a field DCP itself never looks at
        with open(saved / DCP_METADATA_FILE, "rb") as f:
            metadata = pickle.load(f)
        metadata.planner_data = {"x": Payload(marker)}
        payload = pickle.dumps(metadata)
    (saved / DCP_METADATA_FILE).write_bytes(payload)
    with pytest.raises(CheckpointError, match=re.escape(str(saved / DCP_METADATA_FILE))):
        _load(_mlp(), saved)
    with pytest.raises(CheckpointError, match="unsafe"):
        consolidate_checkpoint(saved, tmp_path / "out.ckpt")
    assert not marker.exists()


def test_pickled_entry_stored_by_dcp_is_refused(saved, tmp_path):
    """DCP stores non-tensor values as pickles that its own planner would unpickle with weights_only=False."""
    marker = tmp_path / "pwned"
    entries = {f"model/{k}": v for k, v in _mlp().state_dict().items()}
    entries["model/net.0.weight"] = Payload(marker)  # not a tensor: DCP pickles it
    for f in saved.glob("__*"):
        f.unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_save(entries, checkpoint_id=saved)
    with pytest.raises(CheckpointError, match=r"'model/net\.0\.weight' is BytesStorageMetadata"):
        _load(_mlp(), saved)
    with pytest.raises(CheckpointError, match="Refusing to unpickle"):
        SafeLoadPlanner().load_bytes(SimpleNamespace(dest_index=SimpleNamespace(fqn="x")), io.BytesIO())
    assert not marker.exists()


# -- damaged or mismatched checkpoints name the file or key ----------------------------------------------------------
def test_missing_truncated_and_corrupted_shard_files_are_named(saved):
    shard = next(saved.glob("__*.distcp"))
    data = shard.read_bytes()

    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=re.escape(f"{shard} is truncated")):
        _load(_mlp(), saved)

    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF  # same size, one bit of tensor data off: torch.load alone would not notice
    shard.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match=re.escape(f"{shard} is corrupted")):
        _load(_mlp(), saved)

    shard.unlink()
    with pytest.raises(CheckpointError, match=re.escape(f"{shard} is missing")):
        _load(_mlp(), saved)


def test_corrupted_metadata_and_incomplete_directory_are_named(saved):
    (saved / DCP_METADATA_FILE).write_bytes(b"\x80\x04garbage")
    with pytest.raises(CheckpointError, match=re.escape(str(saved / DCP_METADATA_FILE))):
        _load(_mlp(), saved)
    (saved / LIGHTNING_STATE_FILE).unlink()
    with pytest.raises(CheckpointError, match=f"has no {LIGHTNING_STATE_FILE}, so it is not a checkpoint"):
        _load(_mlp(), saved)


def test_checkpoint_of_a_different_model_names_the_keys(saved):
    other = nn.Sequential(nn.Linear(6, 16), nn.Linear(16, 3))
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint \['0\.bias'") as error:
        _load(other, saved)
    assert "unexpected key(s) ['net.0.bias'" in str(error.value)
    assert str(saved) in str(error.value)


def test_mismatched_shape_names_the_key_and_both_shapes(saved):
    expected = r"Shape mismatch for 'net\.0\.weight': .* has \(16, 6\), the model has \(8, 6\)"
    with pytest.raises(CheckpointError, match=expected):
        _load(_mlp(hidden=8), saved)


# -- atomic commit ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("existing", ["nothing", "directory", "file", "symlink"])
def test_commit_replaces_whatever_is_there_and_leaves_nothing_behind(tmp_path, existing):
    final, staged, target = tmp_path / "last.ckpt", tmp_path / ".last.ckpt.partial-1", tmp_path / "other.ckpt"
    staged.mkdir()
    (staged / "new").write_text("new")
    target.mkdir()
    if existing == "directory":
        final.mkdir()
        (final / "old").write_text("old")
    elif existing == "file":
        final.write_text("old single-file checkpoint")
    elif existing == "symlink":
        final.symlink_to(target.name)
    commit(staged, final)
    assert final.is_dir()
    assert not final.is_symlink()
    assert (final / "new").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "other.ckpt"]
    os.symlink(target.name, tmp_path / "link.ckpt")
    remove(tmp_path / "link.ckpt")  # removing a link never touches what it points to
    remove(final)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.ckpt"]


# -- a crash inside the commit where the filesystem cannot exchange (NFS, Lustre, FUSE) -------------------------------
class _Crash(BaseException):
    """The process dies here: nothing after it runs, no cleanup either."""


def _weights_of(offset: float) -> MLP:
    module = _mlp()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(offset)
    return module


def _loaded_weights(path: Path) -> dict[str, torch.Tensor]:
    module = _mlp()
    _load(module, path)
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _same(a: dict[str, torch.Tensor], b: nn.Module) -> bool:
    return all(torch.equal(a[n], p) for n, p in b.named_parameters())


CRASH_POINTS = ["before the first rename", "between the renames", "before deleting the previous one"]


def _crash_in_second_commit(final: Path, point: str, first: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Save twice under ``final``, the second time on a filesystem that cannot exchange, dying at ``point``.

    ``first="without exchange"``: the first save too (``final`` is a link); ``"with exchange"``: a real directory."""
    with monkeypatch.context() as patch:
        if first == "without exchange":
            patch.setattr(local_commit, "_exchange", lambda a, b: False)
        _save(_weights_of(0.0), final)
    assert final.is_symlink() == (first == "without exchange")
    renames: list[tuple[str, str]] = []
    rename = os.rename

    def rename_or_die(src: Any, dst: Any) -> None:
        if Path(dst).parent != final.parent:  # DCP's own renames inside the staged directory
            return rename(src, dst)
        renames.append((os.fspath(src), os.fspath(dst)))
        if (point, len(renames)) in (("before the first rename", 1), ("between the renames", 2)):
            raise _Crash
        return rename(src, dst)

    def die(path: Path, missing_ok: bool = False) -> None:
        raise _Crash

    with monkeypatch.context() as patch:
        patch.setattr(local_commit, "_exchange", lambda a, b: False)
        patch.setattr(sharded_checkpoint, "abandon_save", lambda staged, target: None)  # a dead process cleans nothing
        patch.setattr(local_commit.os, "rename", rename_or_die)
        if point == "before deleting the previous one":
            patch.setattr(local_commit, "_delete", die)
        with pytest.raises(_Crash):
            _save(_weights_of(1.0), final)
    assert len(renames) == (1 if point == "before the first rename" else 2), renames


@pytest.mark.parametrize("first", ["without exchange", "with exchange"])
@pytest.mark.parametrize("point", CRASH_POINTS)
def test_a_crash_in_a_commit_without_exchange_leaves_a_checkpoint_that_the_next_save_keeps(
    tmp_path, point, first, monkeypatch
):
    final = tmp_path / "last.ckpt"
    _crash_in_second_commit(final, point, first, monkeypatch)
    expected = _weights_of(1.0 if point == "before deleting the previous one" else 0.0)
    # Committed through a link, the name never goes missing; only replacing a real directory can leave that moment.
    assert final.exists() == (first == "without exchange" or point != "between the renames")
    if final.exists():
        assert _same(_loaded_weights(final), expected)
    # The next save of the name starts by staging its directory: the checkpoint is there, and stays there.
    stage_save(locate(final))
    assert final.exists()
    assert _same(_loaded_weights(final), expected)
    # ... and once it commits, only the new checkpoint is left (a link and the one directory it names, or the
    # directory itself).
    monkeypatch.setattr(local_commit, "_exchange", lambda a, b: False)
    _save(_weights_of(2.0), final)
    assert final.is_symlink() == (first == "without exchange")
    assert _same(_loaded_weights(final), _weights_of(2.0))
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".last.ckpt.data-")] == ["last.ckpt"]
    assert len(list(tmp_path.iterdir())) == (2 if first == "without exchange" else 1)
    remove(final)
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_left_between_the_renames_is_found_by_a_load_and_by_the_directory_scan(tmp_path, monkeypatch):
    final, other = tmp_path / "a" / "last.ckpt", tmp_path / "b" / "last.ckpt"
    for path in (final, other):
        path.parent.mkdir()
        _crash_in_second_commit(path, "between the renames", "with exchange", monkeypatch)
        assert not path.exists()
    # Loading the name puts the previous checkpoint back and loads it.
    assert _same(_loaded_weights(final), _weights_of(0.0))
    assert recover_interrupted_commits(other.parent) == [other]
    assert _same(_loaded_weights(other), _weights_of(0.0))
    assert recover_interrupted_commits(other.parent) == []


def test_removing_a_link_made_by_lightning_keeps_what_it_points_to(tmp_path, monkeypatch):
    monkeypatch.setattr(local_commit, "_exchange", lambda a, b: False)
    target = _save(_mlp(), tmp_path / "epoch=0-step=1.ckpt")
    assert target.is_symlink()  # committed as a link: this filesystem "cannot exchange"
    (tmp_path / "last.ckpt").symlink_to(target.name)  # Lightning's save_last="link"
    remove(tmp_path / "last.ckpt")
    assert _loaded_weights(target)


def test_without_exchange_or_links_a_commit_renames_through_the_previous_name(tmp_path, monkeypatch):
    def no_links(*args: Any) -> None:
        raise OSError("symbolic links are not supported")

    monkeypatch.setattr(local_commit, "_exchange", lambda a, b: False)
    monkeypatch.setattr(local_commit.os, "symlink", no_links)
    final = tmp_path / "last.ckpt"
    for offset in (0.0, 1.0):
        _save(_weights_of(offset), final)
        assert final.is_dir()
        assert not final.is_symlink()
        assert _same(_loaded_weights(final), _weights_of(offset))
        assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


# -- a process killed while removing a checkpoint: Note [atomic removal] -----------------------------------------------
_SLOW_REMOVALS = """
import importlib.util, os, sys, threading, time
from pathlib import Path

spec = importlib.util.spec_from_file_location("local_commit", sys.argv[1])  # torch, not the whole package
local_commit = importlib.util.module_from_spec(spec)
spec.loader.exec_module(local_commit)
unlink = os.unlink
def slow_unlink(*args, **kwargs):  # removals long enough to be killed in the middle of
    time.sleep(0.02)
    return unlink(*args, **kwargs)
os.unlink = slow_unlink
for path in sys.argv[2:]:
    threading.Thread(target=local_commit.remove_local, args=(Path(path),)).start()
"""


def _kill_while_removing(paths: list[Path]) -> None:
    """Remove the checkpoints ``paths`` at once in another process and SIGKILL it once part of each one's files are
    deleted."""
    import signal
    import subprocess
    import sys
    import time

    files = min(sum(1 for _ in path.resolve().rglob("*")) for path in paths)
    script = [sys.executable, "-c", _SLOW_REMOVALS, local_commit.__file__, *map(str, paths)]
    child = subprocess.Popen(script)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            trash = [t.resolve() for t in paths[0].parent.glob(".*.trash-*")]
            left = [sum(1 for _ in t.rglob("*")) for t in trash if t.exists()]
            if len(left) == len(paths) and all(0 < n < files - 3 for n in left):
                break
            assert child.poll() is None, "the removals finished before they could be killed"
            time.sleep(0.005)
        else:
            raise AssertionError("the removals never started")
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()


def test_removals_killed_midway_leave_nothing_hidden_past_the_next_save_of_any_checkpoint(tmp_path, monkeypatch):
    as_directory = _save(_mlp(), tmp_path / "epoch=0-step=2.ckpt")
    with monkeypatch.context() as patch:  # a filesystem that cannot exchange: the checkpoint is a link to its data
        patch.setattr(local_commit, "_exchange", lambda a, b: False)
        as_link = _save(_mlp(), tmp_path / "epoch=0-step=3.ckpt")
    assert as_link.is_symlink()
    assert not as_directory.is_symlink()
    for doomed in (as_directory, as_link):
        for i in range(60):  # enough files for a removal to be caught in the middle
            (doomed / f"extra-{i}").write_bytes(b"x")
    (tmp_path / "notes.txt").write_text("the user's")
    (tmp_path / ".hidden-by-the-user").write_text("the user's too")
    _kill_while_removing([as_directory, as_link])
    for doomed in (as_directory, as_link):  # removed in one step: the name held the whole checkpoint or nothing
        assert not os.path.lexists(doomed)
    assert len(list(tmp_path.glob(".*.trash-*"))) == 2  # killed in the middle: each left as trash
    # The next save, of another name (epoch=N-step=M names never come back), deletes both, and nothing else.
    _save(_weights_of(1.0), tmp_path / "epoch=0-step=4.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hidden-by-the-user", "epoch=0-step=4.ckpt", "notes.txt"]
    assert _same(_loaded_weights(tmp_path / "epoch=0-step=4.ckpt"), _weights_of(1.0))
