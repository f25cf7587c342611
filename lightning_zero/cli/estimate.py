"""``python -m lightning_zero estimate``: model-state memory per rank and communication per step, for every stage.

    python -m lightning_zero estimate --params 7.5e9 --gpus 64    # the ZeRO paper's formula
    python -m lightning_zero estimate --model gpt7b --gpus 1024   # the strategy's own layout of a conf/model/ GPT
    python -m lightning_zero estimate --model gpt7b --gpus 64 --plot memory.png --plot-gpus 8 64 1024  # a picture

The first applies the ZeRO paper's formula (Ψ parameters, N ranks, K bytes of optimizer state per parameter): with
``--params 7.5e9 --gpus 64`` it prints the paper's example, 120.0, 31.4, 16.6 and 1.9 GB for DDP and stages 1-3.
The second builds the ``LitGPT`` of ``conf/model/<name>.yaml`` on the ``meta`` device, as ``ZeroStrategy`` does for
stage 3, and lays it out with the strategy's own code as rank 0 of N: ``build_buckets`` over the optimizer's param
groups (stages 1 and 2, as ``ZeroOptimizer``), the unit policy ``find_unit_roots`` / ``assign_parameters`` and
``unit_bucket_layout`` (stage 3, as ``shard_module``), and ``segments_of`` for master weights and optimizer state.
Its bytes are exact, padding included, and follow any change to the policy or the bucketing. Meta tensors have
shapes and no storage, so nothing is allocated and no process is started either way.

Note [estimate for rank 0]
Every flat bucket is padded to a multiple of N and cut into N equal shards with the padding at the end, so every
rank holds shards of the same size and rank 0's shards are all real elements. Rank 0 therefore holds the most master
weights and optimizer state of any rank (the last one holds padding in their place): exactly the paper's formula
for Ψ + P parameters, P being the padding the estimate reports. Laying out one rank is one pass over the
parameters, whatever N.
"""

from __future__ import annotations

import argparse
import math
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, NamedTuple

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_zero.cli.estimate_tables import (
    ALL_REDUCE,
    GATHER_AFTER_STEP,
    GATHER_BACKWARD,
    GATHER_FORWARD,
    GATHER_PERSISTENT,
    REDUCE_SCATTER,
    format_estimates,
    format_tiers,
    format_traffic,
    format_units,
)
from lightning_zero.cli.estimate_zeropp import format_zeropp
from lightning_zero.config import ZeroConfig
from lightning_zero.lightning.memory import ModelStateBytes, expected_model_state_bytes
from lightning_zero.models.lightning_gpt import LitGPT
from lightning_zero.sharding.flat_bucket import FlatBucket, build_buckets
from lightning_zero.sharding.param_groups import segments_of, trainable_named_groups
from lightning_zero.stage3.sharded_init import unit_bucket_layout
from lightning_zero.stage3.wrap_policy import assign_parameters, find_unit_roots

Precision = Literal["bf16", "fp16", "fp32"]
PARAM_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4}
RANK = 0  # Note [estimate for rank 0]
DEFAULT_CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
WIDTH = 118  # prose lines; the tables are as wide as they need

# The collectives of each stage's optimizer step, in the order the traffic table lists them.
STAGE_COLLECTIVES = {
    0: (ALL_REDUCE,),
    1: (REDUCE_SCATTER, GATHER_AFTER_STEP),
    2: (REDUCE_SCATTER, GATHER_AFTER_STEP),
    3: (GATHER_FORWARD, GATHER_BACKWARD, REDUCE_SCATTER),
}


class Precisions(NamedTuple):
    """Bytes per parameter element of each kind of model state."""

    param: int
    """Parameters, and gradients (same dtype)."""
    master: int
    """fp32 master copy: 4 with 16-bit parameters, 0 with fp32 ones (they are their own master)."""
    optimizer: int
    """Optimizer state besides the master copy (Adam: 8). ``master + optimizer`` is the paper's K."""

    @classmethod
    def of(cls, precision: Precision, k: int | None) -> Precisions:
        param = PARAM_BYTES[precision]
        master = 4 if param < 4 else 0
        k = master + 8 if k is None else k
        if k < master:
            raise ValueError(
                f"Invalid K: {k!r} bytes per parameter is less than the {master}-byte fp32 master copy that "
                f"{precision} parameters need. HINT: K counts master weights and optimizer state (12 for Adam)."
            )
        return cls(param, master, k - master)

    @property
    def k(self) -> int:
        return self.master + self.optimizer


class Traffic(NamedTuple):
    """One collective of a step and the bytes this rank sends in it, counted as ``comm.collectives`` counts them."""

    collective: str
    sent: int
    formula: int
    """The paper's bytes for the same collective (0 where the paper has none)."""


class UnitSize(NamedTuple):
    """A stage-3 gather unit and the elements gathered on every rank while it is in use, padding included."""

    name: str
    numel: int


class StageEstimate(NamedTuple):
    """One stage's numbers for one rank."""

    stage: int
    """0 for DDP."""
    state: ModelStateBytes
    """Bytes this rank holds (the strategy's layout in ``--model`` mode, the formula otherwise)."""
    formula: ModelStateBytes
    """The ZeRO paper's formula for the same model and N."""
    traffic: tuple[Traffic, ...]
    """Bytes this rank sends per optimizer step, by collective."""
    buckets: int
    """Flat buckets the parameters are packed into; 0 for the formula."""
    padding: int
    """Elements of padding in the full flat buffers (each bucket is padded to a multiple of N, < N elements)."""
    units: tuple[UnitSize, ...] = ()
    """Stage 3 in ``--model`` mode: every gather unit, the root unit first."""

    @property
    def sent(self) -> int:
        return sum(t.sent for t in self.traffic)

    @property
    def largest_unit(self) -> UnitSize | None:
        """The unit whose full parameters one rank gathers at once: stage 3's transient peak of parameter memory."""
        return max(self.units, key=lambda u: u.numel, default=None)


# -- the formula -------------------------------------------------------------------------------------------------------
def _formula(num_params: int, world_size: int, stage: int, p: Precisions) -> ModelStateBytes:
    return expected_model_state_bytes(num_params, world_size, stage, p.param, p.master, p.optimizer)


def _paper_traffic(num_params: int, world_size: int, stage: int, param_bytes: int) -> tuple[Traffic, ...]:
    one_way = num_params * param_bytes * (world_size - 1) // world_size  # a ring's Ψ(N-1)/N
    sizes = {ALL_REDUCE: 2 * one_way}
    return tuple(Traffic(c, sizes.get(c, one_way), sizes.get(c, one_way)) for c in STAGE_COLLECTIVES[stage])


def paper_estimates(num_params: int, world_size: int, precisions: Precisions) -> list[StageEstimate]:
    """Every stage by the ZeRO paper's formula: model state and bytes sent per step by each rank."""
    out = []
    for stage in STAGE_COLLECTIVES:
        formula = _formula(num_params, world_size, stage, precisions)
        traffic = _paper_traffic(num_params, world_size, stage, precisions.param)
        out.append(StageEstimate(stage, formula, formula, traffic, 0, 0))
    return out


# -- the strategy's own layout -----------------------------------------------------------------------------------------
def load_model(name: str, conf_dir: Path = DEFAULT_CONF_DIR) -> LitGPT:
    """The ``LitGPT`` of ``conf/model/<name>.yaml``, composed and instantiated by Hydra as the example does. Its
    GPT is not built yet: ``build_on_meta`` does that."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from lightning_zero.hydra.schema import register_configs

    available = sorted(p.stem for p in (conf_dir / "model").glob("*.yaml"))
    if name not in available:
        raise ValueError(
            f"Unknown model config {name!r} in {conf_dir / 'model'}. Expected one of {available}. "
            "HINT: pass a name from conf/model/ or --config-dir pointing at another conf/ directory."
        )
    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir.resolve()), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"model={name}"])
    model: LitGPT = instantiate(cfg.model, _convert_="all")
    return model


def build_on_meta(module: LitGPT) -> Optimizer:
    """Run ``configure_model`` on the meta device, as ``ZeroStrategy`` does for stage 3, and return the optimizer of
    ``configure_optimizers`` (an optimizer allocates its state at its first step, so it holds nothing)."""
    with torch.device("meta"):
        module.configure_model()
    return module.configure_optimizers()


def _master_numel(buckets: Sequence[FlatBucket], group_of: dict[int, int]) -> int:
    """Elements of this rank's shards that get a master weight and optimizer state, as ``ZeroOptimizer`` cuts them."""
    return sum(seg.stop - seg.start for b in buckets for seg in segments_of(b, group_of))


def _ring(buckets: Sequence[FlatBucket], param_bytes: int) -> int:
    """Bytes one rank sends to all-gather, or reduce-scatter, these buckets: its shard to each of N-1 others."""
    return sum(b.shard_numel * (b.world_size - 1) for b in buckets) * param_bytes


def _traffic(stage: int, sent: dict[str, int], num_params: int, world_size: int, p: Precisions) -> tuple[Traffic, ...]:
    paper = {t.collective: t.formula for t in _paper_traffic(num_params, world_size, stage, p.param)}
    return tuple(Traffic(c, nbytes, paper.get(c, 0)) for c, nbytes in sent.items() if nbytes or c in paper)


def layout_estimates(
    module: nn.Module, optimizer: Optimizer, world_size: int, precisions: Precisions, config: ZeroConfig
) -> list[StageEstimate]:
    """Every stage as the strategy lays ``module`` out on rank 0 of ``world_size`` (Note [estimate for rank 0]).

    ``module`` should be on the meta device, and is used up: laying it out makes its parameters views into flat
    buffers (without storage on meta). ``optimizer`` is the one ``configure_optimizers`` returns for it; ``config``
    supplies ``bucket_numel`` and the stage-3 unit policy.
    """
    n, p = world_size, precisions
    named_groups = trainable_named_groups(module, optimizer)
    group_of = {id(t): g for g, named in enumerate(named_groups) for _, t in named}
    num_params = sum(t.numel() for t in module.parameters())
    ddp = _formula(num_params, n, 0, p)  # DDP has no layout of its own: the formula is exact
    out = [StageEstimate(0, ddp, ddp, _paper_traffic(num_params, n, 0, p.param), 0, 0)]

    # Stages 1 and 2: ZeroOptimizer's buckets. Parameters are views into the full padded buffers (those outside the
    # optimizer stay as they are); stage 1 keeps full padded gradients, stage 2 only its shard.
    buckets = build_buckets(named_groups, config.bucket_numel, RANK, n, list(module.parameters()))
    padded = sum(b.padded_numel for b in buckets)
    outside = sum(t.numel() for t in module.parameters() if id(t) not in group_of)
    masters = _master_numel(buckets, group_of)
    stage1 = ModelStateBytes((padded + outside) * p.param, padded * p.param, masters * p.master, masters * p.optimizer)
    stage2 = stage1._replace(gradients=sum(b.shard_numel for b in buckets) * p.param)
    sent = {REDUCE_SCATTER: _ring(buckets, p.param), GATHER_AFTER_STEP: _ring(buckets, p.param)}
    padding = sum(b.padded_numel - b.numel for b in buckets)
    for stage, state in ((1, stage1), (2, stage2)):
        traffic = _traffic(stage, sent, num_params, n, p)
        out.append(StageEstimate(stage, state, _formula(num_params, n, stage, p), traffic, len(buckets), padding))
    out.append(_stage3(module, group_of, num_params, n, p, config))
    return out


def _stage3(
    module: nn.Module, group_of: dict[int, int], num_params: int, n: int, p: Precisions, config: ZeroConfig
) -> StageEstimate:
    """``shard_module``'s units and their buckets. On meta a resident bucket keeps its full buffer for free, so every
    bucket is built resident and only its sizes are read."""
    unit_roots = find_unit_roots(module, config)
    units: list[UnitSize] = []
    sharded: list[FlatBucket] = []
    persistent: list[FlatBucket] = []
    names = ["<root>", *(name for name, _ in unit_roots)]
    for name, named in zip(names, assign_parameters(module, unit_roots), strict=True):
        mine: list[FlatBucket] = []
        for resident, members in unit_bucket_layout(named, config):
            (persistent if resident else mine).append(FlatBucket(-1, -1, members, RANK, n))
        sharded += mine
        units.append(UnitSize(name, sum(b.padded_numel for b in mine)))
    trainable = [b for b in sharded + persistent if b.trainable]  # the gradient reducer's buckets
    stepped = [b for b in trainable if any(id(t) in group_of for t in b.params)]  # the optimizer's
    masters = _master_numel(stepped, group_of)
    params = sum(b.shard_numel for b in sharded) + sum(b.padded_numel for b in persistent)
    grads = sum(b.shard_numel for b in trainable)
    state = ModelStateBytes(params * p.param, grads * p.param, masters * p.master, masters * p.optimizer)
    sent = {GATHER_FORWARD: _ring(sharded, p.param), GATHER_BACKWARD: _ring(sharded, p.param)}
    sent[REDUCE_SCATTER] = _ring(trainable, p.param)
    sent[GATHER_PERSISTENT] = _ring([b for b in stepped if any(b is q for q in persistent)], p.param)
    every = sharded + persistent
    padding = sum(b.padded_numel - b.numel for b in every)
    traffic = _traffic(3, sent, num_params, n, p)
    return StageEstimate(3, state, _formula(num_params, n, 3, p), traffic, len(every), padding, tuple(units))


def _tier_settings(args: argparse.Namespace) -> str:
    return (
        f"offload_optimizer = {args.offload_optimizer}, offload_params = {args.offload_params} (stage 3 only), "
        f"offload_ratio = {args.offload_ratio:g}"
    )


def _parse_count(text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"expected a positive whole number such as 7.5e9 or 64, got {text!r}")
    return int(value)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_zero estimate",
        description=__doc__.split("\nNote ")[0],  # the notes are for readers of the code
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=_parse_count, help="number of parameters Ψ, e.g. 7.5e9 (the formula)")
    what.add_argument("--model", help="a config name from conf/model/, e.g. gpt7b (the strategy's own layout)")
    parser.add_argument("--gpus", type=_parse_count, required=True, help="data-parallel ranks N")
    parser.add_argument(
        "--precision", choices=sorted(PARAM_BYTES), default="bf16", help="parameters and gradients (default: bf16)"
    )
    k_help = (
        "optimizer-state bytes per parameter, fp32 master copy included (default: Adam's 12 for 16-bit, 8 for fp32)"
    )
    parser.add_argument("-K", "--optimizer-bytes", type=int, default=None, metavar="K", help=k_help)
    defaults = ZeroConfig()
    for field, kind in (("bucket_numel", _parse_count), ("wrap_min_numel", int), ("persistence_threshold", int)):
        default = getattr(defaults, field)
        parser.add_argument(f"--{field.replace('_', '-')}", type=kind, default=default, help=f"ZeroConfig.{field}")
    parser.add_argument(
        "--wrap-module-classes",
        nargs="*",
        metavar="CLASS",
        help="ZeroConfig.wrap_module_classes (default: None, the repeated layers; the flag alone: no class)",
    )
    parser.add_argument(
        "--ranks-per-node", type=int, default=None, help="also show ZeRO++ at stage 3 on nodes of this many ranks"
    )
    for field in ("offload_optimizer", "offload_params"):
        parser.add_argument(
            f"--{field.replace('_', '-')}", choices=["none", "cpu", "disk"], default="none", help=f"ZeroConfig.{field}"
        )
    parser.add_argument("--offload-ratio", type=float, default=1.0, help="ZeroConfig.offload_ratio")
    parser.add_argument("--config-dir", type=Path, default=DEFAULT_CONF_DIR, help="the conf/ directory")
    plot_help = "also write a PNG of each stage's model state per rank by memory tier: none, host, disk (matplotlib)"
    parser.add_argument("--plot", type=Path, default=None, metavar="FILE", help=plot_help)
    parser.add_argument("--plot-gpus", type=_parse_count, nargs="+", metavar="N", help="--plot: a panel per N (--gpus)")
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    n = args.gpus
    try:
        precisions = Precisions.of(args.precision, args.optimizer_bytes)
        if args.model is None:
            num_params = args.params
            estimates = paper_estimates(num_params, n, precisions)
            title = f"Ψ = {num_params:,} parameters"
        else:
            classes = None if args.wrap_module_classes is None else tuple(args.wrap_module_classes)
            sizes = {f: getattr(args, f) for f in ("bucket_numel", "wrap_min_numel", "persistence_threshold")}
            config = ZeroConfig(stage=3, wrap_module_classes=classes, **sizes)
            module = load_model(args.model, args.config_dir)
            optimizer = build_on_meta(module)
            num_params = sum(t.numel() for t in module.parameters())
            estimates = layout_estimates(module, optimizer, n, precisions, config)
            title = f"{args.model}: Ψ = {num_params:,} parameters"
    except (ValueError, TypeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    exact = args.model is not None
    intro = f"{title} on N = {n:,} ranks; {args.precision} parameters and gradients ({precisions.param} bytes), "
    intro += f"K = {precisions.k} (fp32 masters {precisions.master} + optimizer state {precisions.optimizer}). "
    if exact:
        intro += (
            f"Model state of rank 0 as the strategy lays the model out: stages 1-2 in buckets of bucket_numel = "
            f"{config.bucket_numel:,}; stage 3 in units by wrap_module_classes = {config.wrap_module_classes}, "
            f"wrap_min_numel = {config.wrap_min_numel:,}, persistence_threshold = {config.persistence_threshold:,}. "
            "Padding (elements) makes each bucket split into N equal shards; rank 0 holds the formula for Ψ + padding. "
        )
    else:
        intro += "Model state per rank by the ZeRO paper's formula. "
    print(textwrap.fill(intro + "Decimal units: 1 GB = 10^9 bytes.", width=WIDTH), end="\n\n")
    print(format_estimates(estimates, exact))
    print("\nBytes each rank sends per step:\n")
    print(format_traffic(estimates, exact))
    if exact:
        print("\n" + textwrap.fill(format_units(estimates[3], precisions.param), width=WIDTH))
    if args.offload_optimizer != "none" or args.offload_params != "none":
        print(f"\nModel state per rank by memory tier ({_tier_settings(args)}):\n")
        print(format_tiers(estimates, args.offload_optimizer, args.offload_params, args.offload_ratio))
    if args.ranks_per_node is not None:
        try:
            print("\n" + format_zeropp(num_params, n, args.ranks_per_node, precisions.param))
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    if args.plot is not None:
        from lightning_zero.cli.estimate_plot import plot_memory_by_tier

        layout = config if exact else None
        panels = {w: estimates if w == n else _estimates_at(args, w, precisions, layout) for w in args.plot_gpus or [n]}
        what = f"Model state per rank by stage and memory tier: {args.model or title}, {args.precision}"
        plot_memory_by_tier(panels, args.plot, f"{what}, K = {precisions.k}", args.offload_ratio)
        print(f"\nchart written to {args.plot}")
    return 0


def _estimates_at(
    args: argparse.Namespace, world: int, precisions: Precisions, config: ZeroConfig | None
) -> list[StageEstimate]:
    """Every stage at another world size, for ``--plot-gpus`` (a layout uses its meta model up: a fresh one)."""
    if config is None:
        return paper_estimates(args.params, world, precisions)
    module = load_model(args.model, args.config_dir)
    return layout_estimates(module, build_on_meta(module), world, precisions, config)
