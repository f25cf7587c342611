"""The documentation's pictures: drawn from the numbers the code computes today (``docs/img/figures.json`` is what
``scripts/docs_figures.py`` drew, recomputed here), each on a page; and ``estimate --plot`` over several world
sizes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

from lightning_zero.__main__ import main as cli
from lightning_zero.cli.estimate import Precisions, paper_estimates
from lightning_zero.cli.estimate_plot import memory_by_tier

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "docs" / "img"


def _figures_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_figures", ROOT / "scripts" / "docs_figures.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_pictures_numbers_are_the_codes_numbers_today():
    committed = json.loads((IMAGES / "figures.json").read_text())
    current = json.loads(json.dumps(_figures_script().figure_data()))  # tuples as lists, as the file holds them
    assert sorted(current) == sorted(committed) == ["benchmarks", "memory_gpt7b", "zeropp_links"]
    for figure in current:
        assert current[figure] == committed[figure], (
            f"docs/img/{figure}: the code's numbers changed. HINT: run `.venv/bin/python scripts/docs_figures.py` "
            "and commit the pictures it redraws."
        )


def test_every_picture_is_on_a_page_and_was_drawn():
    pages = "\n".join(p.read_text() for p in (ROOT / "docs").rglob("*.md"))
    pictures = sorted(p.name for p in IMAGES.glob("*.png"))
    assert pictures == ["benchmark_ratios.png", "memory_gpt7b.png", "zeropp_links.png"], pictures
    for name in pictures:
        assert f"(img/{name})" in pages, f"docs/img/{name} is on no page"
        assert (IMAGES / name).read_bytes().startswith(b"\x89PNG")


def test_the_zeropp_page_quotes_the_pictures_ratio():
    runs = json.loads((IMAGES / "figures.json").read_text())["zeropp_links"]
    inter = {run: sum(row[2] for row in rows) for run, rows in runs.items()}
    ratio = inter["stage 3 + ZeRO++"] / inter["stage 3"]
    assert f"{ratio:.2f}×" in (ROOT / "docs" / "zeropp.md").read_text(), ratio


def test_memory_by_tier_moves_what_each_setting_moves():
    estimates = paper_estimates(1_000_000, 4, Precisions.of("bf16", None))  # 2 + 2 + 12 bytes per parameter
    bars = memory_by_tier(estimates)
    assert list(bars) == ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    assert list(bars["DDP"]) == ["none"]  # DDP has no tiers
    assert bars["DDP"]["none"] == (16_000_000, 0, 0)
    assert bars["ZeRO-1"]["host"] == (4_000_000, 3_000_000, 0)  # params and full grads stay, masters + Adam move
    assert bars["ZeRO-3"]["disk"] == (0, 0, 4_000_000)  # every shard on disk, gradients included
    assert bars["ZeRO-3"]["host"] == (500_000, 3_500_000, 0)  # the gradient shard stays on the device
    for stage in bars.values():
        assert len({sum(tiers) for tiers in stage.values()}) == 1  # a tier moves bytes, never adds or drops them


def test_estimate_plots_a_panel_per_world_size(tmp_path, capsys, monkeypatch):
    import lightning_zero.cli.estimate_plot as estimate_plot

    drawn = {}
    monkeypatch.setattr(estimate_plot, "plot_memory_by_tier", lambda panels, *args: drawn.update(panels))
    assert cli(["estimate", "--params", "7.5e9", "--gpus", "64", "--plot", "x.png", "--plot-gpus", "8", "64"]) == 0
    assert "on N = 64 ranks" in capsys.readouterr().out  # the tables are for --gpus
    assert sorted(drawn) == [8, 64]
    assert round(drawn[64][1].state.total / 1e9, 1) == 31.4  # the paper's stage-1 figure at 64 ranks
    assert drawn[8][3].state.total == 8 * drawn[64][3].state.total  # stage 3: 16Ψ/N
    path = tmp_path / "memory.png"
    monkeypatch.undo()
    assert cli(["estimate", "--params", "7.5e9", "--gpus", "8", "--plot", str(path)]) == 0
    assert path.read_bytes().startswith(b"\x89PNG")
