"""Throughput in the report: samples and tokens per second, FLOPs per step counted by torch's ``FlopCounterMode`` on
the real step, and MFU against a peak, logged and printed under the Trainer (``MemoryReport``) and a Fabric loop
(``ZeroFabricStrategy.throughput``). Note [throughput from the real step]."""

from __future__ import annotations

import csv

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch.loggers import CSVLogger
from torch.utils.flop_counter import FlopCounterMode

from lightning_zero import MemoryReport, ZeroStrategy
from lightning_zero.engine.throughput import batch_sizes
from lightning_zero.fabric.strategy import ZeroFabricStrategy
from lightning_zero.models import GPT, GPTConfig, LitGPT, SyntheticTextDataModule
from lightning_zero.trainer.report import format_report
from tests.harness import run_distributed

TINY = GPTConfig.tiny()
BATCH = 4


def _flops_of_one_step(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> int:
    """The reference: torch's own counter around a plain forward and backward of the same model and batch."""
    with FlopCounterMode(display=False) as counter:
        model.loss(inputs, targets).backward()  # type: ignore[operator]
    return int(counter.get_total_flops())


def test_batch_sizes_are_samples_and_token_ids():
    tokens = torch.zeros(4, 16, dtype=torch.long)
    assert batch_sizes((tokens, tokens)) == (4, 64)
    assert batch_sizes({"input_ids": tokens, "labels": tokens}) == (4, 64)
    assert batch_sizes([torch.zeros(8, 3), torch.zeros(8)]) == (8, 0)  # features, no token ids


def _trainer_run(root: str) -> dict[str, object]:
    report = MemoryReport(log_every_n_steps=2, peak_flops=1e12)
    trainer = pl.Trainer(
        strategy=ZeroStrategy(stage=3),
        accelerator="cpu",
        devices=2,
        max_steps=4,
        limit_val_batches=0,
        logger=CSVLogger(root, name="logs"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[report],
    )
    data = SyntheticTextDataModule(vocab_size=TINY.vocab_size, seq_len=TINY.block_size, batch_size=BATCH, num_train=64)
    trainer.fit(LitGPT(TINY), data)
    torch.manual_seed(0)
    tokens = torch.randint(0, TINY.vocab_size, (BATCH, TINY.block_size))
    assert report.report is not None
    reference = _flops_of_one_step(GPT(TINY), tokens, tokens)
    return {"throughput": report.report.throughput, "reference": reference, "table": format_report(report.report)}


@pytest.mark.timeout(180)
def test_trainer_report_has_throughput_and_flops_counted_on_the_real_step(tmp_path):
    results = run_distributed(_trainer_run, 2, str(tmp_path), init_process_group=False)
    for result in results:
        throughput = result["throughput"]
        assert throughput.steps == 3
        # Stage 3's gathers and reductions add no FLOPs: the count is the model's forward and backward.
        assert throughput.flops_per_step == result["reference"] > 0
        assert throughput.tokens_per_sec == pytest.approx(throughput.samples_per_sec * TINY.block_size)
        tflops = throughput.flops_per_step * throughput.steps / throughput.seconds / 1e12
        assert throughput.tflops_per_device == pytest.approx(tflops)
        assert throughput.utilization == pytest.approx(tflops / 1.0)  # peak_flops=1e12
        assert throughput.utilization_name == "MFU"
    assert "Throughput over 3 step(s) after the first" in results[0]["table"]  # what rank 0 prints
    rows = list(csv.DictReader((tmp_path / "logs" / "version_0" / "metrics.csv").open()))
    logged = [r for r in rows if r.get("throughput/tokens_per_sec")]
    assert logged, rows[0].keys()
    assert all(float(r["throughput/mfu"]) > 0 for r in logged)


def _fabric_run() -> dict[str, object]:
    fabric = Fabric(strategy=ZeroFabricStrategy(stage=2), accelerator="cpu", devices=2)
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(GPT(TINY))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    tokens = torch.randint(0, TINY.vocab_size, (BATCH, TINY.block_size))
    for _ in range(3):
        logits = model(tokens)
        fabric.backward(torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()))
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        model(tokens)  # sampling: not a training step
    strategy = fabric.strategy
    assert isinstance(strategy, ZeroFabricStrategy)
    torch.manual_seed(0)
    reference = GPT(TINY)
    with FlopCounterMode(display=False) as counter:
        logits = reference(tokens)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    return {"throughput": strategy.throughput(), "reference": int(counter.get_total_flops())}


@pytest.mark.timeout(120)
def test_fabric_strategy_reports_the_same_throughput_figures():
    for result in run_distributed(_fabric_run, 2, init_process_group=False):
        throughput = result["throughput"]
        assert throughput.steps == 2
        assert throughput.flops_per_step == result["reference"] > 0
        assert throughput.samples_per_sec > 0
        assert throughput.utilization is None  # a CPU has no peak in Lightning's table
        assert "MFU unknown" in throughput.describe()
        assert set(throughput.metrics()) == {
            "throughput/samples_per_sec",
            "throughput/tokens_per_sec",
            "throughput/tflops_per_device",
        }
