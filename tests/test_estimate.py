"""``python -m lightning_zero estimate``: the paper's formula, and the strategy's own layout of a meta-device model
checked against the formula at scale and against a model the strategy really shards."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

from lightning_zero import ZeroConfig, ZeroOptimizer, shard_module
from lightning_zero.__main__ import main as cli
from lightning_zero.cli.estimate import (
    Precisions,
    StageEstimate,
    Traffic,
    build_on_meta,
    layout_estimates,
    load_model,
    paper_estimates,
)
from lightning_zero.cli.estimate_tables import GATHER_PERSISTENT
from lightning_zero.engine.memory import ModelStateBytes, model_state_bytes
from lightning_zero.models import GPTConfig
from lightning_zero.models.gpt import GPT
from lightning_zero.models.param_groups import param_groups_with_weight_decay
from lightning_zero.stage3.parameter_gatherer import ParameterGatherer
from tests.harness import run_distributed

BF16_ADAM = Precisions.of("bf16", None)
FP32_ADAM = Precisions.of("fp32", None)


def _totals(output: str) -> dict[str, str]:
    """stage -> the "total" column of the model-state table (the first table of the output)."""
    lines = output.split("\n\n")[1].splitlines()
    header = re.split(r"\s{2,}", lines[0])
    column = next(i for i, name in enumerate(header) if name.startswith("total"))
    rows = [re.split(r"\s{2,}", line.strip()) for line in lines[1:]]
    return {row[0]: row[column] for row in rows}


# -- the formula -------------------------------------------------------------------------------------------------------
def test_paper_example_prints_the_papers_four_numbers(capsys):
    assert cli(["estimate", "--params", "7.5e9", "--gpus", "64"]) == 0
    assert _totals(capsys.readouterr().out) == {"DDP": "120.0 GB", "1": "31.4 GB", "2": "16.6 GB", "3": "1.9 GB"}


def test_precision_and_k_flags_change_the_formula(capsys):
    assert cli(["estimate", "--params", "1e9", "--gpus", "8", "--precision", "fp32"]) == 0
    # fp32: 4-byte parameters and gradients; K defaults to 8 (Adam; the parameters are their own master).
    assert _totals(capsys.readouterr().out) == {"DDP": "16.0 GB", "1": "9.0 GB", "2": "5.5 GB", "3": "2.0 GB"}
    assert cli(["estimate", "--params", "1e9", "--gpus", "8", "-K", "16"]) == 0
    assert _totals(capsys.readouterr().out) == {"DDP": "20.0 GB", "1": "6.0 GB", "2": "4.2 GB", "3": "2.5 GB"}


def test_communication_per_step_follows_the_formula():
    psi, n = 1_000_000, 8
    one_way = psi * 2 * (n - 1) // n  # bf16: Ψ(N-1)/N elements of 2 bytes
    sent = {e.stage: [t.sent for t in e.traffic] for e in paper_estimates(psi, n, BF16_ADAM)}
    assert sent == {0: [2 * one_way], 1: [one_way, one_way], 2: [one_way, one_way], 3: [one_way] * 3}


# -- the strategy's layout at scale ------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [8, 64, 1024, 1000])
@pytest.mark.parametrize("name", ["gpt7b", "gpt70b"])
def test_layout_equals_the_zero_formulas_within_its_padding(name, world_size):
    n = world_size
    module = load_model(name)
    config = module.config
    optimizer = build_on_meta(module)
    with torch.device("meta"):  # counted apart from the estimate: a second model, unique parameters only
        reference = GPT(config)
    psi = reference.num_parameters()
    block = sum(t.numel() for t in reference.blocks[0].parameters())

    estimates = layout_estimates(module, optimizer, n, BF16_ADAM, ZeroConfig())
    assert [e.stage for e in estimates] == [0, 1, 2, 3]
    for e in estimates:
        p = psi + e.padding  # every padded buffer splits into N equal shards, so N divides p
        assert 0 <= e.padding < max(e.buckets, 1) * n, e
        assert p % n == 0 or e.stage == 0, e
        # bf16 parameters and gradients, fp32 Adam (K = 12): 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N.
        expected = {0: 16 * psi, 1: 4 * p + 12 * p // n, 2: 2 * p + 14 * p // n, 3: 16 * p // n}[e.stage]
        assert e.state.total == expected, e
        assert e.state.total - e.formula.total <= 16 * e.padding, e
        # Per step: DDP all-reduces 2Ψ(N-1)/N, stages 1-2 move Ψ(N-1)/N twice, stage 3 three times.
        one_way = 2 * p * (n - 1) // n
        sent = [2 * 2 * psi * (n - 1) // n] if e.stage == 0 else [one_way] * (3 if e.stage == 3 else 2)
        assert [t.sent for t in e.traffic] == sent, e
    stage3 = estimates[3]
    assert len(stage3.units) == config.n_layer + 1  # one unit per Block, and the root unit
    largest = stage3.largest_unit
    assert largest is not None
    assert 0 <= largest.numel - max(block, psi - config.n_layer * block) < n
    assert estimates[3].state.total < estimates[2].state.total < estimates[1].state.total < estimates[0].state.total


def test_gpt7b_has_padding_at_1000_ranks():
    # The test above checks the padding arithmetic only if some layout has padding: N = 1000 does not divide gpt7b.
    module = load_model("gpt7b")
    estimates = layout_estimates(module, build_on_meta(module), 1000, BF16_ADAM, ZeroConfig())
    assert all(e.padding > 0 for e in estimates[1:])


# -- the layout is the strategy's own: compared with a model really sharded on 2 ranks --------------------------------
TINY = GPTConfig.tiny(n_layer=3, n_embd=33, n_head=3, vocab_size=101, block_size=16)  # odd sizes: padding at N = 2
POLICIES = {
    "default": ZeroConfig(stage=3),
    "attention-and-mlp": ZeroConfig(stage=3, wrap_module_classes=("CausalSelfAttention", "FeedForward")),
    "size": ZeroConfig(stage=3, wrap_module_classes=(), wrap_min_numel=4_000),
    "persistent-vectors": ZeroConfig(stage=3, persistence_threshold=200),
}
SMALL_BUCKETS = 3_000  # several buckets per param group for stages 1 and 2


def _meta_gpt() -> tuple[GPT, torch.optim.Optimizer]:
    with torch.device("meta"):
        model = GPT(TINY)
    return model, torch.optim.AdamW(param_groups_with_weight_decay(model, 0.1))


def _real_step(model: GPT, optimizer: ZeroOptimizer) -> tuple[ModelStateBytes, dict[str, int]]:
    tokens = torch.randint(0, TINY.vocab_size, (2, 9))
    optimizer.zero_grad()
    model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    optimizer.step()  # measured here, with the gradients a step holds (zero_grad frees stage 2-3's shards)
    gatherer = optimizer.gatherer
    assert gatherer is None or isinstance(gatherer, ParameterGatherer)
    # The model's traffic; the few bytes of the per-step "got a gradient" all-reduce (Note [unused parameters]) are
    # not the model's and the estimate leaves them out.
    sent = {kind: nbytes for kind, nbytes in optimizer.ledger.last_step_bytes().items() if kind != "all_reduce"}
    return model_state_bytes(model, [optimizer], gatherer), sent


def _shard_for_real() -> dict[str, object]:
    torch.manual_seed(0)
    out: dict[str, object] = {}
    for policy, config in POLICIES.items():
        model, adamw = _meta_gpt()
        gatherer = shard_module(model, config, dist.group.WORLD, torch.device("cpu"))
        out[policy] = [(u.name, u.numel) for u in gatherer.units]
        out[f"stage 3 {policy}"] = _real_step(model, ZeroOptimizer(model, adamw, dist.group.WORLD, config, gatherer))
    for stage in (1, 2):
        model = GPT(TINY)
        adamw = torch.optim.AdamW(param_groups_with_weight_decay(model, 0.1))
        config = ZeroConfig(stage=stage, bucket_numel=SMALL_BUCKETS)
        out[f"stage {stage}"] = _real_step(model, ZeroOptimizer(model, adamw, dist.group.WORLD, config))
    return out


def _sent_by_kind(traffic: tuple[Traffic, ...]) -> dict[str, int]:
    """The estimate's traffic keyed as ``CommLedger.last_step_bytes()`` keys what was really sent."""
    kinds: dict[str, int] = {}
    for t in traffic:
        kind = "reduce_scatter" if t.collective.startswith("reduce-scatter") else "all_gather"
        kinds[kind] = kinds.get(kind, 0) + t.sent
    return kinds


@pytest.mark.timeout(120)
def test_estimate_is_what_the_strategy_really_holds_and_sends():
    ranks = run_distributed(_shard_for_real, 2)
    real = ranks[0]  # the estimate is rank 0's (Note [estimate for rank 0])
    largest = {}
    for policy, config in POLICIES.items():
        model, adamw = _meta_gpt()
        stage3 = layout_estimates(model, adamw, 2, FP32_ADAM, config)[3]
        # The same units as shard_module builds, with the same gathered sizes, so the same largest unit.
        assert [(u.name, u.numel) for u in stage3.units] == real[policy], policy
        largest[policy] = stage3.largest_unit
        state, sent = real[f"stage 3 {policy}"]
        assert stage3.state == state, policy
        assert _sent_by_kind(stage3.traffic) == sent, policy
        assert all(r[f"stage 3 {policy}"][0].total <= state.total for r in ranks)  # rank 0 holds the most
        assert stage3.padding > 0
    # Each policy gives another largest unit: the figure follows the policy, not a fixed split.
    assert len({u.numel for u in largest.values() if u is not None}) == len(POLICIES), largest
    assert any(t.collective == GATHER_PERSISTENT for t in _stage3_traffic("persistent-vectors"))

    model, adamw = _meta_gpt()
    estimates = layout_estimates(model, adamw, 2, FP32_ADAM, ZeroConfig(bucket_numel=SMALL_BUCKETS))
    for stage in (1, 2):
        state, sent = real[f"stage {stage}"]
        assert estimates[stage].state == state, stage
        assert _sent_by_kind(estimates[stage].traffic) == sent, stage
        assert estimates[stage].buckets > 2


def _stage3_traffic(policy: str) -> tuple[Traffic, ...]:
    model, adamw = _meta_gpt()
    return layout_estimates(model, adamw, 2, FP32_ADAM, POLICIES[policy])[3].traffic


# -- the command line --------------------------------------------------------------------------------------------------
def test_model_mode_prints_the_layouts_exact_bytes_and_largest_unit(capsys):
    module = load_model("small")
    expected = layout_estimates(module, build_on_meta(module), 7, BF16_ADAM, ZeroConfig())
    assert cli(["estimate", "--model", "small", "--gpus", "7"]) == 0
    out = capsys.readouterr().out
    assert f"Ψ = {GPT(GPTConfig.small()).num_parameters():,} parameters" in out
    for e in expected:
        assert f"{e.state.total:,}" in out
        assert all(f"{t.sent:,}" in out for t in e.traffic)
    largest = expected[3].largest_unit
    assert largest is not None
    assert f"the largest, gathered in full on every rank while in use: {largest.name!r}, {largest.numel:,}" in out


def test_policy_flags_reach_the_layout(capsys):
    config = ZeroConfig(wrap_module_classes=("FeedForward",), persistence_threshold=300, bucket_numel=100_000)
    expected = _small_layout(config)
    flags = ["--wrap-module-classes", "FeedForward", "--persistence-threshold", "300", "--bucket-numel", "1e5"]
    assert cli(["estimate", "--model", "small", "--gpus", "4", *flags]) == 0
    out = capsys.readouterr().out
    assert all(f"{e.state.total:,}" in out for e in expected)
    largest, default = expected[3].largest_unit, _small_layout(ZeroConfig())[3].largest_unit
    assert largest is not None
    assert default is not None
    assert largest.numel != default.numel
    assert f"in use: {largest.name!r}, {largest.numel:,} elements" in out


def _small_layout(config: ZeroConfig) -> list[StageEstimate]:
    module = load_model("small")
    return layout_estimates(module, build_on_meta(module), 4, BF16_ADAM, config)


def test_model_config_is_composed_like_the_example():
    assert load_model("small").config == GPTConfig.small()


def test_unknown_model_names_the_choices(capsys):
    assert cli(["estimate", "--model", "smal", "--gpus", "8"]) == 2
    err = capsys.readouterr().err
    assert "Unknown model config 'smal'" in err
    assert "gpt70b" in err
    assert "HINT" in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--wrap-module-classes", "Blok"], "Invalid ZeroConfig.wrap_module_classes: ['Blok']"),
        (["--persistence-threshold", "-1"], "Invalid ZeroConfig.persistence_threshold: -1"),
        (["--wrap-min-numel", "-5"], "Invalid ZeroConfig.wrap_min_numel: -5"),
    ],
)
def test_bad_policy_flags_name_the_field(capsys, flags, message):
    assert cli(["estimate", "--model", "tiny", "--gpus", "8", *flags]) == 2
    assert message in capsys.readouterr().err


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


def test_model_state_by_tier_moves_what_each_tier_holds():
    from lightning_zero.engine.memory import ModelStateBytes, model_state_by_tier

    state = ModelStateBytes(parameters=100, gradients=100, master_weights=200, optimizer_state=400)
    assert model_state_by_tier(state, 3, "disk", "disk") == (0, 0, 800)
    assert model_state_by_tier(state, 3, "disk", "none") == (100, 0, 700)
    assert model_state_by_tier(state, 3, "cpu", "cpu") == (100, 700, 0)  # gradients stay with the device
    assert model_state_by_tier(state, 2, "disk", "none", ratio=0.5) == (500, 0, 300)
    assert model_state_by_tier(state, 1, "cpu", "none") == (200, 600, 0)
    assert model_state_by_tier(state, 0, "none", "none") == (800, 0, 0)


def test_estimate_prints_bytes_per_tier(capsys):
    from lightning_zero.__main__ import main as cli

    assert cli(["estimate", "--params", "1e9", "--gpus", "2", "--precision", "fp32", "--offload-optimizer", "disk",
                "--offload-params", "disk"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    tiers = out.split("by memory tier")[1]
    stage3 = next(line for line in tiers.splitlines() if line.strip().startswith("3 "))
    # Stage 3 fp32 Adam, everything on disk: (4 + 4 + 8) bytes x 1e9 / 2 ranks.
    assert stage3.split() == ["3", "0", "B", "0", "B", "8.0", "GB", "8,000,000,000"]
