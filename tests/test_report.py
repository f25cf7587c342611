"""``MemoryReport``: the per-rank table, its JSON, and the chart, on one process and on two ZeRO ranks."""

from __future__ import annotations

import json
import sys

import lightning.pytorch as pl
import pytest

from lightning_zero import ZeroStrategy
from lightning_zero.engine.memory import ModelStateBytes
from lightning_zero.models import GPTConfig, LitGPT, SyntheticTextDataModule
from lightning_zero.trainer.report import FitReport, MemoryReport, RankReport, format_report
from lightning_zero.trainer.report_plot import memory_by_stage
from tests.harness import run_distributed

TINY = GPTConfig.tiny()
TINY_PARAMS = 120_576


def _fit(strategy: object, devices: int, report: MemoryReport, root: str) -> pl.Trainer:
    trainer = pl.Trainer(
        strategy=strategy,  # type: ignore[arg-type]
        accelerator="cpu",
        devices=devices,
        max_steps=2,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[report],
        default_root_dir=root,
    )
    data = SyntheticTextDataModule(vocab_size=TINY.vocab_size, seq_len=TINY.block_size, batch_size=4, num_train=32)
    trainer.fit(LitGPT(TINY), data)
    return trainer


def _report(stage: int | None = 2, sent: dict[str, int] | None = None) -> FitReport:
    ranks = [RankReport(r, 400, 200, 0, 400, 300_000_000, sent or {"reduce_scatter": 200}) for r in range(2)]
    return FitReport("ZeroStrategy", stage, 2, 100, 4, "peak RSS", False, ranks)


def test_table_has_a_row_per_rank_and_a_column_per_collective_used():
    table = format_report(_report(sent={"reduce_scatter": 200, "all_gather": 0, "all_reduce": 0}))
    lines = table.splitlines()
    assert "ZeRO-2, 2 rank(s), 100 parameters (4 bytes each)" in lines[0]
    assert lines[1].split() == ["rank", "params", "grads", "fp32", "master", "optim", "state", "model", "state",
                                "peak", "RSS", "reduce_scatter"]  # fmt: skip
    assert lines[2].split()[0] == "0"
    assert lines[3].split()[0] == "1"
    assert "1.0 kB" in lines[2]  # model state 400 + 200 + 400 bytes
    assert "300.0 MB" in lines[2]


def test_memory_by_stage_uses_the_runs_sizes():
    bars = memory_by_stage(_report())
    assert list(bars) == ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    # 100 fp32 parameters on 2 ranks; rank 0 holds Adam state for 50 of them: 8 bytes each.
    assert bars["DDP"] == ModelStateBytes(400, 400, 0, 800)
    assert bars["ZeRO-2"] == ModelStateBytes(400, 200, 0, 400)
    assert bars["ZeRO-3"] == ModelStateBytes(200, 200, 0, 400)


def test_single_process_report_counts_the_tensors(tmp_path, capsys):
    report = MemoryReport(json_path="report/memory.json")
    _fit("auto", 1, report, str(tmp_path))
    assert "Model state and communication per rank" in capsys.readouterr().out
    saved = json.loads((tmp_path / "report" / "memory.json").read_text())
    assert saved["world_size"] == 1
    assert saved["num_params"] == TINY_PARAMS
    (rank,) = saved["ranks"]
    assert rank["parameters"] == rank["gradients"] == 4 * TINY_PARAMS
    assert rank["optimizer_state"] == 8 * TINY_PARAMS  # AdamW's two fp32 moments
    assert rank["peak_memory"] > rank["parameters"]
    assert rank["sent"] == {"reduce_scatter": 0, "all_gather": 0, "all_reduce": 0}


def _zero2_report(root: str) -> tuple[dict, dict[str, int]]:
    report = MemoryReport(json_path="memory.json")
    trainer = _fit(ZeroStrategy(stage=2), 2, report, root)
    assert report.report is not None
    assert isinstance(trainer.strategy, ZeroStrategy)
    return json.loads(report.report.to_json()), trainer.strategy.communication_per_step()


@pytest.mark.timeout(120)
def test_zero2_report_gathers_every_ranks_row(tmp_path):
    results = run_distributed(_zero2_report, 2, str(tmp_path), init_process_group=False)
    sent_by_rank = [sent for _, sent in results]  # what each rank's strategy says it sent
    for report, _ in results:  # every rank holds the whole table
        assert report["stage"] == 2
        assert [r["rank"] for r in report["ranks"]] == [0, 1]
        for rank, sent in zip(report["ranks"], sent_by_rank, strict=True):
            assert {k: v for k, v in rank["sent"].items() if v} == sent
            assert rank["gradients"] < rank["parameters"]  # stage 2 keeps a gradient shard
    assert json.loads((tmp_path / "memory.json").read_text())["stage"] == 2  # rank 0 wrote it


def test_plot_path_without_matplotlib_fails_at_construction_with_a_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    with pytest.raises(ImportError, match=r"needs matplotlib.*HINT: pip install \"lightning-zero\[plot\]\""):
        MemoryReport(plot_path="memory.png")


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is the optional [plot] extra")
    report = MemoryReport(json_path=None, plot_path="memory.png")
    _fit("auto", 1, report, str(tmp_path))
    assert (tmp_path / "memory.png").read_bytes().startswith(b"\x89PNG")
