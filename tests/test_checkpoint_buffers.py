"""Replicated entries of a checkpoint (BatchNorm statistics, any buffer or frozen tensor) are rank 0's, as in DDP's
checkpoint, even when ranks' copies differ (``broadcast_buffers=False``, each rank on its own data)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from tests.harness import run_distributed
from tests.third_party_models import ProbeModule

RUNS = ["ddp", "zero1", "zero2", "zero3"]


def _save(name: str, root: str) -> dict[str, Any]:
    from lightning_zero import ZeroStrategy

    strategy: Any
    if name == "ddp":
        strategy = DDPStrategy(broadcast_buffers=False)
    else:
        strategy = ZeroStrategy(stage=int(name[-1]), broadcast_buffers=False)
    module = ProbeModule("batchnorm_mlp", steps=3)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=3,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    live = {n: b.clone() for n, b in module.named_buffers()}
    path = Path(root) / f"{name}.ckpt"
    trainer.save_checkpoint(path)
    in_group: dict[str, torch.Tensor] = {}
    if name != "ddp" and trainer.is_global_zero:  # one process of the group consolidates, the others wait
        from lightning_zero.cli.consolidate import consolidate_checkpoint

        full = consolidate_checkpoint(path, Path(root) / f"{name}-in-group.ckpt")
        in_group = {n: t for n, t in torch.load(full, weights_only=True)["state_dict"].items() if n in live}
    trainer.strategy.barrier()
    return {"live": live, "in_group": in_group}


def _all(root: str) -> dict[str, dict[str, Any]]:
    return {name: _save(name, root) for name in RUNS}


@pytest.mark.timeout(200)
def test_saved_buffers_are_rank_zeros_at_every_stage(tmp_path):
    from lightning_zero.cli.consolidate import consolidate_checkpoint

    rank0, rank1 = run_distributed(_all, 2, str(tmp_path), init_process_group=False, timeout=150)
    for name in RUNS:
        full = tmp_path / f"{name}.ckpt"
        if name != "ddp":
            full = consolidate_checkpoint(full, tmp_path / f"{name}-full.ckpt")
        rank0[name]["saved"] = torch.load(full, weights_only=True)["state_dict"]
    for name in RUNS:
        live0, live1, saved = rank0[name]["live"], rank1[name]["live"], rank0[name]["saved"]
        # Without the broadcast, each rank's statistics are its own data's.
        assert not torch.allclose(live0["model.1.running_mean"], live1["model.1.running_mean"]), name
        for buffer, value in live0.items():
            torch.testing.assert_close(saved[buffer], value, rtol=0, atol=0, msg=f"{name} {buffer}")
            torch.testing.assert_close(saved[buffer], rank0["ddp"]["saved"][buffer], msg=f"{name} {buffer} vs DDP")
            if name != "ddp":
                torch.testing.assert_close(rank0[name]["in_group"][buffer], value, rtol=0, atol=0)
