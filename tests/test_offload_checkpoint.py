"""Checkpoints under memory tiers stream through them (Note [checkpoints stream through the tiers]): a save or a load
of a model whose state is on disk keeps only slices of it in memory, resumes bit for bit, and writes the same format
that other world sizes, stages and ``consolidate`` read."""

from __future__ import annotations

import pytest
import torch

from lightning_zero.cli.consolidate import consolidate_checkpoint
from tests.harness import run_distributed
from tests.offload_checkpoint_runs import checkpoint_peaks, streamed_save_and_load


@pytest.mark.timeout(200)
def test_save_and_load_with_every_tier_on_disk_stream_slices_and_resume_bit_identically(tmp_path):
    results = run_distributed(streamed_save_and_load, 2, str(tmp_path), timeout=180)
    for result in results:
        # Nothing of the state became resident for the checkpoint: at most the entries still being written behind
        # when it started (the write-behind budget), never the state itself, which is many entries larger.
        budget = 4 * result["largest_entry"]
        assert result["state_bytes"] > 2 * budget, result
        assert result["save_peak"] <= budget, result
        assert result["load_peak"] <= budget, result
        # ... and yet every byte of it went through the tier file: read for the save, written by the load.
        assert 0.99 * result["state_bytes"] <= result["save_read"] <= result["state_bytes"], result
        assert result["load_written"] >= result["save_read"], result  # (and what the step left to write)
        for name, value in result["saved"].items():
            torch.testing.assert_close(result["loaded"][name], value, rtol=0, atol=0, msg=name)
            torch.testing.assert_close(result["after_second"][name], result["after_first"][name], rtol=0, atol=0)
        assert result["resumed"] == result["continued"]  # masters and Adam's moments came back exactly
    # One rank alone (another world size) loads the two ranks' checkpoint into its own disk tiers, and consolidate
    # reads it: both find the weights that were saved.
    consolidate_checkpoint(tmp_path / "ckpt", tmp_path / "consolidated.ckpt")
    consolidated = torch.load(tmp_path / "consolidated.ckpt", weights_only=True)["state_dict"]
    rank0 = results[0]
    for name, value in rank0["saved"].items():
        torch.testing.assert_close(rank0["single"][name], value, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(consolidated[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.slow  # ~1 minute: 2 + 2 models built into the tiers, each saved and loaded
@pytest.mark.timeout(300)
def test_checkpoints_under_disk_tiers_keep_peak_rss_flat_while_the_model_grows_four_times(tmp_path):
    """Stage 3 with every tier on disk: saving and loading a model 4x deeper (4x the model state) takes the peak
    resident memory of the small one, plus at most a few blocks."""
    for (small, small_state), (large, large_state) in run_distributed(
        checkpoint_peaks, 2, str(tmp_path), [4, 16], timeout=280
    ):
        grown = large_state - small_state
        assert large_state >= 3.5 * small_state
        unit = large_state // 16 // 4  # one block's fp32 parameter shard on this rank, roughly
        # Holding the state for the checkpoint (as before it streamed) would grow the peak by `grown`.
        assert large - small < 0.15 * grown, (small, large, grown)
        assert large < small + 8 * unit, (small, large, unit)
