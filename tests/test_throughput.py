"""Throughput in the report: samples and tokens per second, FLOPs per step counted by torch's FLOP formulas on the
real step (``FlopCount``: ``FlopCounterMode``'s total, without changing a number of the step), and MFU against a peak,
logged and printed under the Trainer (``MemoryReport``) and a Fabric loop (``ZeroFabricStrategy.throughput``).
Note [throughput from the real step], Note [counting without touching the step]."""

from __future__ import annotations

import copy
import csv
from contextlib import AbstractContextManager, nullcontext

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch.loggers import CSVLogger
from torch.utils.flop_counter import FlopCounterMode

from lightning_zero import MemoryReport, ZeroStrategy
from lightning_zero.engine.throughput import FlopCount, StepThroughput, batch_sizes
from lightning_zero.fabric.strategy import ZeroFabricStrategy
from lightning_zero.models import GPT, GPTConfig, LitGPT, SyntheticTextDataModule
from lightning_zero.trainer.report import format_report
from tests.harness import run_distributed
from tests.third_party_models import Fixture, hf_causal_lm

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


def _llama_step(fixture: Fixture, dtype: torch.dtype, counter: AbstractContextManager[object]) -> list[torch.Tensor]:
    """The loss and every gradient of one forward and backward of the fixture's model in ``dtype``, counted or not."""
    model = copy.deepcopy(fixture.model).to(dtype)
    with counter:
        loss = fixture.loss(model, fixture.batch(0, 0))
        loss.backward()
    return [loss.detach(), *(p.grad for p in model.parameters() if p.grad is not None)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_counted_step_is_bit_identical_and_the_count_is_flop_counter_modes(dtype):
    """Note [counting without touching the step], on model code we did not write (a tiny Hugging Face Llama: SwiGLU
    MLPs): the step ``StepThroughput`` counts computes exactly what an uncounted step computes, and its count is
    ``FlopCounterMode``'s on the same step."""
    llama = hf_causal_lm()
    unobserved = _llama_step(llama, dtype, nullcontext())
    throughput = StepThroughput()
    throughput.on_batch(llama.batch(0, 0))
    counted = _llama_step(llama, dtype, nullcontext())  # counted from on_batch to on_step, as in a run
    throughput.on_step()
    reference = FlopCounterMode(display=False)
    by_flop_counter_mode = _llama_step(llama, dtype, reference)
    assert len(counted) == len(unobserved) > 1
    assert all(torch.equal(a, b) for a, b in zip(counted, unobserved, strict=True))
    assert throughput.uncounted is None
    assert throughput.flops_per_step == reference.get_total_flops() > 0
    # Why FlopCount exists: torch's counter runs silu_backward through its decomposition, which rounds otherwise.
    assert not all(torch.equal(a, b) for a, b in zip(by_flop_counter_mode, unobserved, strict=True))


def test_an_op_whose_decomposition_cannot_be_counted_leaves_the_flops_unknown_not_the_step_changed():
    """A decomposition that cannot run on meta tensors (here one that reads a value to the host) makes the FLOPs
    unknown, the report names the op, and the op still computes what it computes unobserved (its own kernel)."""
    library = torch.library.Library("lightning_zero_test", "DEF")
    library.define("reads_a_value(Tensor x) -> Tensor")
    library.impl("reads_a_value", lambda x: x * x.sum().item(), "CompositeImplicitAutograd")
    library.impl("reads_a_value", lambda x: x * (x.sum() + 1), "CPU")  # not the decomposition: which one ran shows
    op = torch.ops.lightning_zero_test.reads_a_value
    x = torch.randn(4, 3)
    unobserved = op(x) @ x.T
    throughput = StepThroughput()
    outs = []
    for _ in range(2):
        throughput.on_batch(x)
        outs.append(op(x) @ x.T)
        throughput.on_step()
    assert all(torch.equal(out, unobserved) for out in outs)
    assert throughput.flops_per_step is None
    summary = throughput.summary(1, torch.device("cpu"), torch.float32, peak_flops=1e12)
    assert summary is not None
    assert summary.utilization is None
    assert summary.tflops_per_device is None
    assert "FLOPs not counted (lightning_zero_test.reads_a_value.default's decomposition" in summary.describe()
    assert "MFU unknown" in summary.describe()
    with FlopCount() as counter:  # the same counter sees the matmul when nothing stops it
        x @ x.T
    assert counter.flops == 2 * 4 * 3 * 4
    assert counter.uncounted is None


def test_a_higher_order_operator_runs_as_unobserved_and_leaves_the_flops_unknown():
    """``torch.cond`` runs its branch below the mode, where no count sees it: it runs as it does unobserved (rather
    than stopping the step, as a dispatch mode without higher-order support does) and the count says it is not
    whole."""
    x, w = torch.randn(4, 3), torch.randn(3, 3)

    def run() -> torch.Tensor:
        (out,) = torch.ops.higher_order.cond(
            x.sum() > -1e9, lambda x, w: ((x @ w).sigmoid(),), lambda x, w: (x.cos(),), (x, w)
        )
        return out @ w

    unobserved = run()
    with FlopCount() as counter:
        counted = run()
    assert torch.equal(counted, unobserved)
    assert counter.uncounted is not None
    assert "higher-order operator cond" in counter.uncounted


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
