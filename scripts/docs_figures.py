"""Draw the documentation's pictures from the code's own numbers, and record those numbers beside them.

    .venv/bin/python scripts/docs_figures.py           # rewrites docs/img/*.png and docs/img/figures.json

- ``memory_gpt7b.png``: model state per rank by stage and memory tier for ``conf/model/gpt7b.yaml`` at 8, 64 and
  1,024 ranks, laid out by the strategy's own partitioner on the meta device (the picture
  ``python -m lightning_zero estimate --model gpt7b --gpus 64 --plot FILE --plot-gpus 8 64 1024`` draws).
- ``zeropp_links.png``: the bytes a rank sends per step to its own node and to other nodes, plain stage 3 against
  ZeRO++ (qwZ, hpZ, qgZ at ``ZeroConfig``'s defaults), for gpt7b on 64 ranks of 8 per node, by the formulas
  ``estimate --ranks-per-node`` prints.
- ``benchmark_ratios.png``: the ratios ``benchmarks/`` measured, read from ``benchmarks/results/*.json``.

``figures.json`` holds every number drawn; ``tests/test_docs_figures.py`` recomputes them from the code and the
results files, so a change that moves a picture's numbers fails until this script is run again.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from lightning_zero.__main__ import main as cli  # noqa: E402
from lightning_zero.cli.estimate import Precisions, build_on_meta, layout_estimates, load_model  # noqa: E402
from lightning_zero.cli.estimate_plot import memory_by_tier, plot_link_bytes, require_matplotlib  # noqa: E402
from lightning_zero.cli.estimate_zeropp import LinkBytes, stage3_link_bytes, zeropp_link_bytes  # noqa: E402
from lightning_zero.config import ZeroConfig  # noqa: E402

IMAGES = ROOT / "docs" / "img"
RESULTS = ROOT / "benchmarks" / "results"
MODEL, WORLDS = "gpt7b", (8, 64, 1024)
ZEROPP_WORLD, ZEROPP_PER_NODE = 64, 8
PAIRED = "paired_step_time_2026-11-26.json"  # the latest paired step times (benchmarks/README.md)


def memory_data() -> dict[str, Any]:
    """What ``memory_gpt7b.png`` draws: bytes on the device, host and disk per stage and tier setting, per N."""
    data: dict[str, Any] = {}
    for world in WORLDS:
        module = load_model(MODEL)
        estimates = layout_estimates(module, build_on_meta(module), world, Precisions.of("bf16", None), ZeroConfig())
        data[str(world)] = {
            stage: {setting: list(tiers) for setting, tiers in bars.items()}
            for stage, bars in memory_by_tier(estimates).items()
        }
    return data


def num_params() -> int:
    module = load_model(MODEL)
    build_on_meta(module)
    return sum(t.numel() for t in module.parameters())


def zeropp_data(psi: int) -> dict[str, Any]:
    """What ``zeropp_links.png`` draws: per collective, bytes to the own node and to other nodes."""
    defaults = ZeroConfig()
    runs = {
        "stage 3": stage3_link_bytes(psi, ZEROPP_WORLD, ZEROPP_PER_NODE, 2),
        "stage 3 + ZeRO++": zeropp_link_bytes(
            psi, ZEROPP_WORLD, ZEROPP_PER_NODE, 2, defaults.quantization_block, defaults.gradient_quantization_bits
        ),
    }
    return {run: [[r.collective, r.intra_node, r.inter_node] for r in rows] for run, rows in runs.items()}


def benchmark_data() -> dict[str, Any]:
    """The measured ratios ``benchmark_ratios.png`` draws, each with the file and date it comes from."""
    paired = json.loads((RESULTS / PAIRED).read_text())
    step = {name: paired["summary"][name]["ratio"] for name in paired["variants"] if name != paired["baseline"]}
    zeropp = json.loads((RESULTS / "zeropp_gpt.json").read_text())["runs"]
    host = json.loads((RESULTS / "host_step.json").read_text())["summary"]
    return {
        "step_time": {"file": PAIRED, "date": paired["machine"]["date"][:10], "ratio_to_ddp": step},
        "zeropp_inter_node": {
            "file": "zeropp_gpt.json",
            "ratio_to_stage3": {run: zeropp[run]["inter_node_ratio"] for run in zeropp},
        },
        "host_step": {
            "file": "host_step.json",
            "cpu_ratio_to_torch_fused": {
                name: host[name]["cpu_times"]["ratio_to_torch_fused"]["median"]
                for name in host
                if "ratio_to_torch_fused" in host[name].get("cpu_times", {})
            },
        },
    }


def _plot_benchmarks(data: dict[str, Any], path: Path) -> None:
    plt = require_matplotlib()
    figure, (left, middle, right) = plt.subplots(1, 3, figsize=(14, 4.2), gridspec_kw={"width_ratios": [3, 1.3, 2]})
    step = data["step_time"]
    names = list(step["ratio_to_ddp"])
    medians = [step["ratio_to_ddp"][n][0] for n in names]
    errors = [[m - step["ratio_to_ddp"][n][1] for n, m in zip(names, medians, strict=True)],
              [step["ratio_to_ddp"][n][2] - m for n, m in zip(names, medians, strict=True)]]  # fmt: skip
    left.bar(names, medians, yerr=errors, capsize=4, color="tab:blue")
    left.axhline(1.0, color="black", linewidth=0.8)
    left.set_ylim(0.8, max(medians) * 1.1)
    left.set_title(
        f"step time / DDP's, paired rounds ({step['date']}, 2 CPU ranks)\nmedian and 95% interval", fontsize=9
    )
    for x, m in enumerate(medians):
        left.annotate(f"{m:.3f}", (x, m), xytext=(8, 2), textcoords="offset points", fontsize=8)
    zeropp = data["zeropp_inter_node"]["ratio_to_stage3"]
    middle.bar(list(zeropp), list(zeropp.values()), color="tab:green")
    middle.set_title("bytes to the other node / plain stage 3's\n(example GPT, 2 nodes x 2 ranks)", fontsize=9)
    for x, v in enumerate(zeropp.values()):
        middle.annotate(f"{v:.3f}", (x, v), ha="center", va="bottom", fontsize=8)
    host = data["host_step"]["cpu_ratio_to_torch_fused"]
    right.bar(list(host), list(host.values()), color="tab:orange")
    right.axhline(1.0, color="black", linewidth=0.8)
    right.set_title("tier optimizer step, CPU time / torch's fused AdamW\n(50M fp32 parameters, median)", fontsize=9)
    for x, v in enumerate(host.values()):
        right.annotate(f"{v:.2f}", (x, v), ha="center", va="bottom", fontsize=8)
    for axes in (left, middle, right):
        axes.tick_params(axis="x", labelsize=8, rotation=15)
        axes.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def figure_data() -> dict[str, Any]:
    return {"memory_gpt7b": memory_data(), "zeropp_links": zeropp_data(num_params()), "benchmarks": benchmark_data()}


def main() -> None:
    IMAGES.mkdir(parents=True, exist_ok=True)
    data = figure_data()
    with contextlib.redirect_stdout(io.StringIO()):  # the tables are in the docs already; only the picture here
        picture = ["--plot", str(IMAGES / "memory_gpt7b.png"), "--plot-gpus", *map(str, WORLDS)]
        code = cli(["estimate", "--model", MODEL, "--gpus", str(WORLDS[-1]), *picture])
    assert code == 0, code
    links = {run: [LinkBytes(*row) for row in rows] for run, rows in data["zeropp_links"].items()}
    title = f"{MODEL} (bf16) on {ZEROPP_WORLD} ranks, {ZEROPP_PER_NODE} per node: bytes per rank and step by link"
    plot_link_bytes(links, IMAGES / "zeropp_links.png", title)
    _plot_benchmarks(data["benchmarks"], IMAGES / "benchmark_ratios.png")
    (IMAGES / "figures.json").write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {', '.join(sorted(p.name for p in IMAGES.iterdir()))} in {IMAGES.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
