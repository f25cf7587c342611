"""Memory tiers under bad input and faults: a clear error before anything is written, a full disk that fails the
job naming it and leaves the previous checkpoint resumable, private directories per job, nothing left behind."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_zero import ZeroConfig
from lightning_zero.engine.tier_setup import build_memory_tiers
from lightning_zero.offload.directory import (
    OffloadDirectory,
    OffloadDirectoryError,
    check_free_space,
    free_bytes,
    resolve_offload_dir,
)
from lightning_zero.offload.swap_file import SwapFile
from tests.harness import run_distributed
from tests.offload_faults import disk_fills_during_training, disk_too_small


def test_missing_absolute_offload_dir_is_refused_naming_it(tmp_path):
    missing = tmp_path / "not-there"
    with pytest.raises(OffloadDirectoryError, match=rf"ZeroConfig\.offload_dir: '{missing}'.*does not exist"):
        resolve_offload_dir(str(missing), tmp_path)
    assert not missing.exists()


def test_relative_offload_dir_is_created_under_the_root_dir(tmp_path):
    assert resolve_offload_dir("a/b", tmp_path) == tmp_path / "a" / "b"
    assert (tmp_path / "a" / "b").is_dir()


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write to any directory")
def test_unwritable_offload_dir_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(OffloadDirectoryError, match="not writable"):
        resolve_offload_dir(str(locked), tmp_path)


def test_free_space_check_names_the_bytes_needed_and_free(tmp_path):
    free = free_bytes(tmp_path)
    per_rank = free // 2 + free // 8  # fits once, not twice: ranks of one machine share its disk
    check_free_space(tmp_path, per_rank, 1, "the test state")
    needed = 2 * per_rank
    with pytest.raises(OffloadDirectoryError, match=rf"needs {needed:,} bytes .*{per_rank:,} per rank x 2 .* has"):
        check_free_space(tmp_path, per_rank, 2, "the test state")


def test_two_jobs_with_the_same_offload_dir_get_private_directories_and_files(tmp_path):
    first, second = OffloadDirectory(tmp_path, 0), OffloadDirectory(tmp_path, 0)
    assert first.path != second.path
    assert first.path.parent == second.path.parent == tmp_path
    a = SwapFile(first.file("tiers.bin"))
    with pytest.raises(FileExistsError):  # a file that exists belongs to another job: never opened
        SwapFile(first.file("tiers.bin"))
    b = SwapFile(second.file("tiers.bin"))
    a.write("x", torch.ones(8))
    b.write("x", torch.zeros(8))
    out = torch.empty(8)
    a.read("x", out)
    assert torch.equal(out, torch.ones(8))
    a.close()
    b.close()
    first.remove()
    assert not first.path.exists()
    assert second.path.exists()
    second.remove()


@pytest.mark.timeout(200)
def test_disk_full_fails_the_job_naming_it_and_the_last_checkpoint_resumes_exactly():
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(disk_fills_during_training, 2, root, 2, init_process_group=False, timeout=180)
    for result in results:
        assert result["failure"] is not None, "the job went on with a full disk"
        assert "TierIOError" in result["failure"]
        assert "the disk is full" in result["failure"]
        assert "tiers.bin" in result["failure"]
        assert result["left"] == [], f"tier files left after the failure: {result['left']}"
        assert result["saved"] == ["epoch=0-step=2.ckpt"]
        resumed, straight = result["resumed"], result["straight"]
        torch.testing.assert_close(resumed["losses"], straight["losses"][2:], rtol=1e-5, atol=0)
        for name, value in straight["weights"].items():
            torch.testing.assert_close(resumed["weights"][name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.timeout(120)
def test_too_little_free_space_is_refused_before_anything_is_written():
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(disk_too_small, 2, root, 1000, init_process_group=False, timeout=100)
        assert not list(Path(root).rglob("tiers.bin"))
    for result in results:
        assert result["failure"] is not None
        assert "Not enough free space for the disk tier" in result["failure"]
        assert "the disk has 1,000 bytes" in result["failure"]
        assert result["left"] == []


def test_disk_tier_on_a_gpu_is_refused_naming_the_field(tmp_path):
    config = ZeroConfig(stage=3, offload_params="disk", offload_dir=str(tmp_path))
    ranks = SimpleNamespace(global_rank=0, root_device=torch.device("cuda", 0), world_size=2, num_processes=2)
    with pytest.raises(NotImplementedError, match=r"ZeroConfig\.offload_params='disk' on a cuda device"):
        build_memory_tiers(config, torch.nn.Linear(2, 2), str(tmp_path), ranks)
    assert list(tmp_path.iterdir()) == []  # refused before anything was written
