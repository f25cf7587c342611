"""Stage 3 and mixtures of experts whose routing changes from step to step: leaf modules (Note [leaf modules] in
``stage3/wrap_policy.py``) through the Trainer against DDP with ``find_unused_parameters=True``, 2 ranks on gloo."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_zero import RankDivergenceError, ZeroConfig
from lightning_zero.cli.estimate import Precisions, layout_estimates
from lightning_zero.cli.estimate_tables import format_units
from lightning_zero.stage3.wrap_policy import find_unit_roots, leaf_modules
from tests.boundary_models import MoELM
from tests.harness import run_distributed
from tests.third_party_models import BUILDERS, Optimizer, TopOneMoE, hf_mixtral_routing, moe_routing

DDP = "ddp_find_unused_parameters_true"


Strategy = str | dict[str, Any]
"""A registered strategy's name, or the keywords of a ``ZeroStrategy`` (built in the rank: strategies don't pickle)."""


def _fits(builder: str, strategies: list[Strategy], optimizer: Optimizer) -> list[dict[str, Any]]:
    from lightning_zero import ZeroStrategy
    from tests.third_party_models import fit_probe

    return [
        fit_probe(builder, ZeroStrategy(**s) if isinstance(s, dict) else s, optimizer=optimizer) for s in strategies
    ]


def _divergence_message(builder: str, strategy: dict[str, Any]) -> str:
    from lightning_zero import ZeroStrategy
    from tests.third_party_models import fit_probe

    try:
        fit_probe(builder, ZeroStrategy(**strategy))
    except RankDivergenceError as error:
        return str(error)
    return "trained without RankDivergenceError"


def _assert_match(reference: dict[str, Any], candidate: dict[str, Any], label: str) -> None:
    torch.testing.assert_close(
        torch.tensor(candidate["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=1e-6, msg=label
    )
    assert candidate["weights"].keys() == reference["weights"].keys()
    for name, expected in reference["weights"].items():
        torch.testing.assert_close(candidate["weights"][name], expected, rtol=1e-5, atol=1e-6, msg=f"{label}: {name}")


def _check(builder: str, strategies: list[Strategy], optimizer: Optimizer = "adamw") -> list[list[dict[str, Any]]]:
    ranks = run_distributed(_fits, 2, builder, strategies, optimizer, init_process_group=False, timeout=150)
    for reference, *others in ranks:
        assert len(reference["losses"]) == 6
        for index, run in enumerate(others, start=1):
            _assert_match(reference, run, f"{builder}: strategy {index} vs {DDP}")
    assert ranks[0][0]["losses"] != ranks[1][0]["losses"]  # the ranks trained on different data
    return ranks


# -- (a) the tests' TopOneMoE, routed differently at every step and on every rank -------------------------------------


def test_routing_of_the_shifting_moe_changes_after_the_first_step():
    rank0, rank1 = moe_routing(0, 6, "moe_shifting"), moe_routing(1, 6, "moe_shifting")
    assert rank0[0] == rank1[0]  # the first step cannot tell the experts are data-dependent
    assert set(rank0[2]) - set(rank0[0])  # a rank calls an expert in step 3 that it did not call in step 1
    assert any(a != b for a, b in zip(rank0[1:], rank1[1:], strict=True))
    assert any({0, 1, 2, 3} - set(a) - set(b) for a, b in zip(rank0, rank1, strict=True))  # unused everywhere


@pytest.mark.timeout(180)
def test_moe_whose_routing_changes_after_the_first_step_matches_ddp_find_unused():
    ranks = _check("moe_shifting", [DDP, "zero3"])
    # The routing trained through is the planned one (the router's weights move little in 6 steps).
    model = BUILDERS["moe_shifting"]().model
    assert isinstance(model, TopOneMoE)
    model.load_state_dict(ranks[0][1]["weights"])
    for rank in (0, 1):
        with torch.no_grad():
            for step, planned in enumerate(moe_routing(rank, 6, "moe_shifting")):
                model(BUILDERS["moe_shifting"]().batch(rank, step)[0])
                assert model.last_routing is not None
                assert sorted(set(model.last_routing.tolist())) == planned


@pytest.mark.timeout(120)
def test_moe_whose_routing_changes_after_the_first_step_fails_without_leaves_naming_the_units_and_the_knob():
    """``leaf_module_classes=()`` turns the automatic rule off: the first step shows no divergence to merge, so the
    third step's gathers part ways and the check stops them, naming both units and the class to declare a leaf."""
    messages = run_distributed(
        _divergence_message, 2, "moe_shifting", {"stage": 3, "leaf_module_classes": ()}, init_process_group=False
    )
    for message in messages:
        assert "ranks are about to gather different units" in message, message
        assert "'model.experts." in message, message
        assert "HINT:" in message
        assert "`ZeroConfig.leaf_module_classes=('TopOneMoE',)`" in message, message


# -- (b) Hugging Face mixtures of experts ----------------------------------------------------------------------------


def test_hugging_face_moe_routing_varies_between_ranks_and_steps():
    rank0, rank1 = hf_mixtral_routing(0, 6), hf_mixtral_routing(1, 6)
    assert rank0[0] != rank1[0]
    first = set(rank0[0][0])
    assert any(set(step[0]) - first for step in rank0[1:])  # experts rank 0 calls later that it did not call first
    assert len({tuple(map(tuple, step)) for step in rank0}) == 6


@pytest.mark.timeout(180)
def test_hugging_face_mixtral_with_varying_routing_matches_ddp_find_unused():
    _check("hf_mixtral", [DDP, "zero3"])


@pytest.mark.timeout(180)
def test_hugging_face_switch_transformers_experts_are_leaves_and_match_ddp_find_unused():
    """Switch Transformers' sparse MLPs call only the experts (a ``ModuleDict``) that received a token. With the
    size threshold each expert would be a unit of its own; as a leaf each container of experts is gathered whole (by
    default with its block, under the threshold as a unit of its own).
    SGD with momentum: the encoder's gradients differ from DDP's in the last bit from the first step on (sums in
    another order: zero2's are exact), and AdamW's normalization grows that to 1e-4 relative on the weights of an
    expert that a single token reached, within 6 steps, under the default units as under these."""
    _check("hf_switch", [DDP, "zero3", {"stage": 3, "wrap_min_numel": 2000}], optimizer="sgd")


# -- (c) the explicit knob --------------------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_leaf_module_classes_makes_a_mixture_the_rule_misses_match_ddp_find_unused():
    """``RoutedBranches`` keeps its experts in ``branches``: the automatic rule misses it and training stops with
    the HINT naming it; listed in ``leaf_module_classes`` (by name or qualified name) it matches DDP."""
    messages = run_distributed(_divergence_message, 2, "routed_branches", {"stage": 3}, init_process_group=False)
    assert all("`ZeroConfig.leaf_module_classes=('RoutedBranches',)`" in m for m in messages), messages
    _check(
        "routed_branches",
        [
            DDP,
            {"stage": 3, "leaf_module_classes": ("RoutedBranches",)},
            {"stage": 3, "leaf_module_classes": ("tests.third_party_models.RoutedBranches",)},
        ],
    )


# -- the rule, without processes --------------------------------------------------------------------------------------


def _names(modules: list[tuple[str, nn.Module]]) -> list[str]:
    return [name for name, _ in modules]


class _ExpertsNextToLayers(nn.Module):
    """A model-level ``experts`` list between two layers (the composition tests' ``VaryingMoE`` shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))


def test_automatic_leaves_are_the_containers_of_experts_and_nothing_else():
    config = ZeroConfig(stage=3)
    assert _names(leaf_modules(BUILDERS["moe"]().model, config)) == ["experts"]
    assert _names(find_unit_roots(BUILDERS["moe"]().model, config)) == []  # the experts stay in the root unit
    assert _names(leaf_modules(MoELM(), config)) == ["blocks.0.experts", "blocks.1.experts"]
    assert _names(find_unit_roots(MoELM(), config)) == ["blocks.0", "blocks.1"]  # no expert is a unit
    # The layers next to a model-level list of experts stay units: only the container is a leaf.
    assert _names(find_unit_roots(_ExpertsNextToLayers(), config)) == ["layers.0", "layers.1"]
    switch = BUILDERS["hf_switch"]().model
    experts = [f"encoder.block.{b}.layer.1.mlp.experts" for b in range(2)]
    experts += [f"decoder.block.{b}.layer.2.mlp.experts" for b in range(2)]
    assert _names(leaf_modules(switch, config)) == experts
    assert not [
        n for n in _names(find_unit_roots(switch, ZeroConfig(stage=3, wrap_min_numel=2000))) if ".experts." in n
    ]
    # Layers, attention and fused experts are no leaves: the decoder layers stay units.
    assert _names(leaf_modules(BUILDERS["hf_mixtral"]().model, config)) == []
    assert _names(find_unit_roots(BUILDERS["hf_mixtral"]().model, config)) == ["model.layers.0", "model.layers.1"]
    assert _names(leaf_modules(BUILDERS["hf_causal_lm"]().model, config)) == []
    assert _names(leaf_modules(BUILDERS["routed_branches"]().model, config)) == []  # what the knob is for


class _Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(8, 16), nn.Linear(16, 8)


class MixtralSparseMoeBlock(nn.Module):
    """The shape of transformers 4's Mixtral block: a router and a ``ModuleList`` of experts it skips unless hit."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 4, bias=False)
        self.experts = nn.ModuleList(_Expert() for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        choice = self.gate(x).argmax(-1)
        out = torch.zeros_like(x)
        for index in choice.unique().tolist():  # only the experts that received a token
            expert = self.experts[index]
            out[choice == index] = expert.w2(expert.w1(x[choice == index]))
        return out


class _DecoderLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(8, 8)
        self.block_sparse_moe = MixtralSparseMoeBlock()

    def forward(self, x: Tensor) -> Tensor:
        h = x + self.attn(x)
        out: Tensor = h + self.block_sparse_moe(h)
        return out


def test_transformers_4_mixtral_shape_is_a_leaf_inside_its_decoder_layer_unit():
    model = nn.Sequential(nn.Embedding(10, 8), nn.ModuleList(_DecoderLayer() for _ in range(2)))
    config = ZeroConfig(stage=3)
    assert _names(leaf_modules(model, config)) == ["1.0.block_sparse_moe.experts", "1.1.block_sparse_moe.experts"]
    assert _names(find_unit_roots(model, config)) == ["1.0", "1.1"]  # the experts are not units of their own


def test_estimate_reports_leaves_inside_their_units():
    """The estimate lays stage 3 out with the policy ``shard_module`` uses: with a size threshold that would make
    each expert a unit, each of Switch Transformers' containers of experts is one unit instead (a leaf may be a
    unit; nothing inside it is), and the largest unit holds all the experts of a layer."""
    model = BUILDERS["hf_switch"]().model
    experts_numel = sum(p.numel() for p in model.get_submodule("encoder.block.0.layer.1.mlp.experts").parameters())
    adamw = torch.optim.AdamW(model.parameters())
    config = ZeroConfig(stage=3, wrap_min_numel=2000)
    stage3 = layout_estimates(model, adamw, 2, Precisions.of("fp32", None), config)[3]
    names = [u.name for u in stage3.units]
    assert names == ["<root>", *_names(find_unit_roots(model, config))]
    assert "encoder.block.0" in names
    assert not [n for n in names if ".experts." in n]
    assert [n for n in names if n.endswith(".experts")] == _names(leaf_modules(model, config))
    assert stage3.largest_unit is not None
    assert stage3.largest_unit.numel >= experts_numel
    assert format_units(stage3, 4).startswith(f"Stage 3: {len(names)} gather units; the largest")


def test_leaf_module_classes_replaces_the_rule_and_is_checked_against_the_model():
    model = MoELM()
    assert _names(find_unit_roots(model, ZeroConfig(stage=3, leaf_module_classes=()))) == [
        name for b in range(2) for name in (f"blocks.{b}", *(f"blocks.{b}.experts.{e}" for e in range(4)))
    ]
    only_first = find_unit_roots(model, ZeroConfig(stage=3, leaf_module_classes=("tests.boundary_models.MoEBlock",)))
    assert _names(only_first) == ["blocks.0", "blocks.1"]
    with pytest.raises(ValueError, match=r"leaf_module_classes: \['MoEBlok'\] name no module class of MoELM") as error:
        find_unit_roots(model, ZeroConfig(stage=3, leaf_module_classes=("MoEBlok",)))
    assert "HINT:" in str(error.value)
    assert ZeroConfig(leaf_module_classes=["MoEBlock"]).leaf_module_classes == ("MoEBlock",)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"Invalid ZeroConfig\.leaf_module_classes: 'MoEBlock'"):
        ZeroConfig(leaf_module_classes="MoEBlock")  # type: ignore[arg-type]
