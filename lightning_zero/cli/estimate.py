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
from pathlib import Path

import torch
from torch.optim import Optimizer

from lightning_zero.cli.estimate_module import (
    auto_decision,
    init_args,
    instantiate,
    is_class_path,
    micro_batch,
    predict_stages,
    unknown_arguments,
)
from lightning_zero.cli.estimate_tables import (
    format_estimates,
    format_peaks,
    format_tiers,
    format_traffic,
    format_units,
    peak_intro,
)
from lightning_zero.cli.estimate_zeropp import format_zeropp
from lightning_zero.config import ZeroConfig
from lightning_zero.models.lightning_gpt import LitGPT
from lightning_zero.planning.layout import (
    PARAM_BYTES,
    Precision,
    Precisions,
    StageEstimate,
    Traffic,
    UnitSize,
    layout_estimates,
    paper_estimates,
)
from lightning_zero.planning.module_step import first_optimizer
from lightning_zero.planning.peak import PeakPrediction

__all__ = [
    "Precision",
    "Precisions",
    "StageEstimate",
    "Traffic",
    "UnitSize",
    "build_on_meta",
    "layout_estimates",
    "load_model",
    "main",
    "paper_estimates",
]

DEFAULT_CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
WIDTH = 118  # prose lines; the tables are as wide as they need


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
    what.add_argument(
        "--model",
        help="a config name from conf/model/ (gpt7b), or a LightningModule class path (my_project.LitLlama) with its "
        "init args as --model.KEY=VALUE: the strategy's own layout, and the peak per rank of a training step",
    )
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
    peak = parser.add_argument_group(
        "peak per rank in a training step (--model): the step run on fake tensors, activations included"
    )
    peak.add_argument("--data", default=None, help="a LightningDataModule class path whose first batch is used")
    peak.add_argument("--micro-batch", type=int, default=None, help="samples per micro-batch (default: the loader's)")
    peak.add_argument(
        "--auto",
        action="store_true",
        help="print the configuration stage='auto' would choose (Note [automatic configuration]) and stop",
    )
    peak.add_argument("--device-budget", type=float, default=None, help="--auto: device bytes per rank (1e10)")
    peak.add_argument("--host-budget", type=float, default=None, help="--auto: host-tier bytes per rank")
    peak.add_argument("--offload-dir", default=None, help="--auto: ZeroConfig.offload_dir, for the disk tier")
    peak.add_argument(
        "--activation-checkpointing",
        nargs="+",
        metavar="CLASS",
        default=None,
        help="ZeroConfig.activation_checkpointing_policy: the layer classes that recompute their activations",
    )
    plot_help = "also write a PNG of each stage's model state per rank by memory tier: none, host, disk (matplotlib)"
    parser.add_argument("--plot", type=Path, default=None, metavar="FILE", help=plot_help)
    parser.add_argument("--plot-gpus", type=_parse_count, nargs="+", metavar="N", help="--plot: a panel per N (--gpus)")
    return parser


def main(argv: list[str]) -> int:
    args, extra = _parser().parse_known_args(argv)
    unknown = unknown_arguments(extra)
    if unknown:
        _parser().error(f"unrecognized arguments: {' '.join(unknown)}")
    n = args.gpus
    peaks: list[PeakPrediction] = []
    try:
        precisions = Precisions.of(args.precision, args.optimizer_bytes)
        if args.model is None:
            num_params = args.params
            estimates = paper_estimates(num_params, n, precisions)
            title = f"Ψ = {num_params:,} parameters"
        else:
            classes = None if args.wrap_module_classes is None else tuple(args.wrap_module_classes)
            sizes = {f: getattr(args, f) for f in ("bucket_numel", "wrap_min_numel", "persistence_threshold")}
            tiers = {f: getattr(args, f) for f in ("offload_optimizer", "offload_params", "offload_ratio")}
            policy = None if args.activation_checkpointing is None else tuple(args.activation_checkpointing)
            config = ZeroConfig(
                stage=3, wrap_module_classes=classes, activation_checkpointing_policy=policy, **sizes, **tiers
            )
            if is_class_path(args.model):
                module = instantiate(args.model, init_args(extra, "model"))
            else:
                module = load_model(args.model, args.config_dir)
            if args.auto:
                batch = micro_batch(module, args.data, init_args(extra, "data"), args.micro_batch)
                print(auto_decision(module, batch, config, args))
                return 0
            if is_class_path(args.model) or args.micro_batch is not None:
                batch = micro_batch(module, args.data, init_args(extra, "data"), args.micro_batch)
                peaks = predict_stages(module, batch, config, n, args.precision)  # before the layout uses it up
            with torch.device("meta"):
                module.configure_model()
            optimizer = first_optimizer(module.configure_optimizers())
            num_params = sum(t.numel() for t in module.parameters())
            estimates = layout_estimates(module, optimizer, n, precisions, config)
            title = f"{args.model}: Ψ = {num_params:,} parameters"
    except (ValueError, TypeError, RuntimeError) as error:
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
    if peaks:
        print("\n" + textwrap.fill(peak_intro(peaks, args.precision), width=WIDTH), end="\n\n")
        print(format_peaks(peaks))
    if args.plot is not None:
        from lightning_zero.cli.estimate_plot import plot_memory_by_tier

        layout = config if exact else None
        worlds = args.plot_gpus or [n]
        panels = {w: estimates if w == n else _estimates_at(args, extra, w, precisions, layout) for w in worlds}
        what = f"Model state per rank by stage and memory tier: {args.model or title}, {args.precision}"
        plot_memory_by_tier(panels, args.plot, f"{what}, K = {precisions.k}", args.offload_ratio)
        print(f"\nchart written to {args.plot}")
    return 0


def _estimates_at(
    args: argparse.Namespace, extra: list[str], world: int, precisions: Precisions, config: ZeroConfig | None
) -> list[StageEstimate]:
    """Every stage at another world size, for ``--plot-gpus`` (a layout uses its meta model up: a fresh one)."""
    if config is None:
        return paper_estimates(args.params, world, precisions)
    if is_class_path(args.model):
        module = instantiate(args.model, init_args(extra, "model"))
    else:
        module = load_model(args.model, args.config_dir)
    with torch.device("meta"):
        module.configure_model()
    return layout_estimates(module, first_optimizer(module.configure_optimizers()), world, precisions, config)
