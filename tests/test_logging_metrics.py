"""``MemoryReport(log_every_n_steps=N)``: per-rank memory and traffic through the Trainer's loggers, beside the loss."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import CSVLogger

from lightning_zero import MemoryReport, ZeroStrategy
from lightning_zero.models import GPTConfig, LitGPT, SyntheticTextDataModule
from lightning_zero.trainer.report import COLLECTIVES
from tests.harness import run_distributed

TINY = GPTConfig.tiny()
KINDS = ("parameters", "gradients", "master_weights", "optimizer_state", "model_state", "peak_memory")


def _fit_with_csv(root: str, stage: int) -> dict[str, object]:
    report = MemoryReport(log_every_n_steps=2)
    trainer = pl.Trainer(
        strategy=ZeroStrategy(stage=stage),
        accelerator="cpu",
        devices=2,
        max_steps=4,
        limit_val_batches=0,
        log_every_n_steps=2,
        logger=CSVLogger(root, name="csv", version=0),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[report],
        default_root_dir=root,
    )
    data = SyntheticTextDataModule(vocab_size=TINY.vocab_size, seq_len=TINY.block_size, batch_size=4, num_train=32)
    trainer.fit(LitGPT(TINY), data)
    assert report.report is not None
    assert isinstance(trainer.strategy, ZeroStrategy)
    return {"final": report.report.ranks, "sent": trainer.strategy.communication_per_step()}


def _rows(root: Path) -> list[dict[str, str]]:
    with (root / "csv" / "version_0" / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [2, 3])
def test_csv_logger_holds_per_rank_memory_and_traffic_beside_the_loss(tmp_path, stage):
    results = run_distributed(_fit_with_csv, 2, str(tmp_path), stage, init_process_group=False)
    rows = _rows(tmp_path)
    memory_rows = [r for r in rows if r.get("memory/rank0/parameters")]
    assert [int(r["step"]) for r in memory_rows] == [1, 3]  # after optimizer steps 2 and 4, at Lightning's step
    loss_steps = {int(r["step"]) for r in rows if r.get("train_loss")}
    assert {1, 3} <= loss_steps  # the loss is logged at the same steps
    for rank, result in enumerate(results):
        final = result["final"][rank]  # type: ignore[index]
        for row in memory_rows:
            figures = {kind: float(row[f"memory/rank{rank}/{kind}"]) for kind in KINDS}
            sent = {c: float(row[f"comm/rank{rank}/{c}"]) for c in COLLECTIVES}
            # The model state does not change shape between steps: each logged figure is the end-of-fit one.
            assert figures["parameters"] == final.parameters > 0
            assert figures["gradients"] == final.gradients > 0
            assert figures["optimizer_state"] == final.optimizer_state > 0
            assert figures["master_weights"] == 0  # fp32 parameters are their own masters
            assert figures["model_state"] == final.model_state.total
            assert 0 < figures["peak_memory"] <= final.peak_memory  # a peak only grows
            # Every step sends the same: what the strategy says its last step sent, per collective.
            assert {c: v for c, v in sent.items() if v} == result["sent"]
            assert sent["reduce_scatter"] > 0
            assert sent["all_gather"] > 0


@pytest.mark.parametrize("bad", [0, -3, True, 1.5])
def test_log_every_n_steps_must_be_a_positive_int(bad):
    with pytest.raises((ValueError, TypeError), match="log_every_n_steps"):
        MemoryReport(log_every_n_steps=bad)  # type: ignore[arg-type]
