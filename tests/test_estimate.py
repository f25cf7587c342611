"""``python -m lightning_zero estimate``: the paper's formula, and the real partitioner on a meta-device model."""

from __future__ import annotations

import re

import pytest

from lightning_zero.__main__ import main as cli
from lightning_zero.cli.estimate import (
    Precisions,
    build_meta_gpt,
    load_model_config,
    paper_estimates,
    simulated_estimates,
    stage3_units,
)
from lightning_zero.models import GPTConfig

BF16_ADAM = Precisions.of("bf16", None)
BYTES_PER_ELEMENT = 2 + 2 + 12  # parameters + gradients + K: the most any padding element can cost


def _totals(output: str) -> dict[str, str]:
    """stage -> the "total" column of the table."""
    lines = output.splitlines()
    header = re.split(r"\s{2,}", next(line for line in lines if line.startswith("stage")))
    column = next(i for i, name in enumerate(header) if name.startswith("total"))
    rows = [re.split(r"\s{2,}", line.strip()) for line in lines if re.match(r"^\s*(DDP|\d)\s", line)]
    return {row[0]: row[column] for row in rows}


def test_paper_example_prints_the_papers_four_numbers(capsys):
    assert cli(["estimate", "--params", "7.5e9", "--gpus", "64"]) == 0
    assert _totals(capsys.readouterr().out) == {"DDP": "120.0", "1": "31.4", "2": "16.6", "3": "1.9"}


def test_precision_and_k_flags_change_the_formula(capsys):
    assert cli(["estimate", "--params", "1e9", "--gpus", "8", "--precision", "fp32"]) == 0
    # fp32: 4-byte parameters and gradients; K defaults to 8 (Adam; the parameters are their own master).
    assert _totals(capsys.readouterr().out) == {"DDP": "16.0", "1": "9.0", "2": "5.5", "3": "2.0"}
    assert cli(["estimate", "--params", "1e9", "--gpus", "8", "-K", "16"]) == 0
    assert _totals(capsys.readouterr().out) == {"DDP": "20.0", "1": "6.0", "2": "4.2", "3": "2.5"}


def test_communication_per_step_follows_the_formula():
    psi, n = 1_000_000, 8
    sent = {e.stage: e.sent for e in paper_estimates(psi, n, BF16_ADAM)}
    two = 2 * psi * (n - 1) // n * 2  # elements * 2 bytes
    assert sent == {0: two, 1: two, 2: two, 3: 3 * psi * (n - 1) // n * 2}


@pytest.mark.parametrize("world_size", [8, 64, 1024, 1000])
def test_simulated_7b_agrees_with_the_formula_within_padding(world_size):
    config = load_model_config("gpt7b")
    estimates = simulated_estimates(config, world_size, BF16_ADAM, bucket_numel=4_000_000)
    assert [e.stage for e in estimates] == [0, 1, 2, 3]
    units = len(stage3_units(build_meta_gpt(config)))
    assert units == config.n_layer + 1
    for e in estimates:
        slack = e.units * world_size * BYTES_PER_ELEMENT  # < N padding elements per bucket or unit
        assert 0 <= e.state.total - e.formula.total <= slack, e
        assert 0 <= e.padding < max(e.units, 1) * world_size, e
        formula_sent = (3 if e.stage == 3 else 2) * 6_658_596_864 * (world_size - 1) // world_size * 2
        assert 0 <= e.sent - formula_sent <= (3 if e.stage == 3 else 2) * e.units * world_size * 2, e
    assert estimates[3].state.total < estimates[2].state.total < estimates[1].state.total < estimates[0].state.total


def test_simulated_mode_counts_padding_exactly():
    # 7 ranks do not divide the small GPT's buckets: each is padded up to a multiple of 7.
    estimates = simulated_estimates(GPTConfig.small(), 7, BF16_ADAM, bucket_numel=4_000_000)
    stage2 = estimates[2]
    assert stage2.units == 2  # the decayed and the undecayed param group
    assert 0 < stage2.padding < 2 * 7
    padded = 3_257_856 + stage2.padding
    assert stage2.state.parameters == padded * 2  # the full padded buffers
    assert stage2.state.gradients == padded // 7 * 2  # this rank's shard
    assert stage2.state.master_weights + stage2.state.optimizer_state == padded // 7 * 12


def test_model_mode_prints_exact_bytes(capsys):
    assert cli(["estimate", "--model", "small", "--gpus", "7"]) == 0
    out = capsys.readouterr().out
    assert "3,257,856 parameters" in out
    assert "13,031,452" in out  # stage 2 on 7 ranks, to the byte (see test_simulated_mode_counts_padding_exactly)


def test_model_config_is_composed_like_the_example():
    assert load_model_config("small") == GPTConfig.small()


def test_unknown_model_names_the_choices(capsys):
    assert cli(["estimate", "--model", "smal", "--gpus", "8"]) == 2
    err = capsys.readouterr().err
    assert "Unknown model config 'smal'" in err
    assert "small" in err
    assert "HINT" in err


def test_k_smaller_than_the_master_copy_is_rejected(capsys):
    assert cli(["estimate", "--params", "1e9", "--gpus", "8", "-K", "2"]) == 2
    assert "Invalid K: 2" in capsys.readouterr().err


def test_bad_counts_are_rejected():
    with pytest.raises(SystemExit):
        cli(["estimate", "--params", "1.5", "--gpus", "8"])
    with pytest.raises(SystemExit):
        cli(["estimate", "--params", "1e9", "--gpus", "0"])


def test_plot_needs_matplotlib_or_writes_a_png(tmp_path, capsys):
    path = tmp_path / "memory.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="HINT"):
            cli(["estimate", "--params", "7.5e9", "--gpus", "64", "--plot", str(path)])
        return
    assert cli(["estimate", "--params", "7.5e9", "--gpus", "64", "--plot", str(path)]) == 0
    assert path.read_bytes().startswith(b"\x89PNG")
