"""``python -m lightning_zero estimate``: model-state memory per rank and communication per step, for every stage.

    python -m lightning_zero estimate --params 7.5e9 --gpus 64           # the ZeRO paper's formula
    python -m lightning_zero estimate --model gpt7b --gpus 1024          # the real partitioner on a conf/model/ GPT

The first applies the ZeRO paper's formula (Ψ parameters, N ranks, K bytes of optimizer state per parameter): with
``--params 7.5e9 --gpus 64`` it prints the paper's example, 120.0, 31.4, 16.6 and 1.9 GB for DDP and stages 1-3.
The second builds the model on the ``meta`` device (no memory) and lays it out with the same ``build_buckets`` the
strategy uses, as rank 0 of N would (no processes), so its bytes are exact, padding included. Nothing is allocated
and no process is started either way.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, NamedTuple

import torch
from torch import nn

from lightning_zero.lightning.memory import ModelStateBytes, expected_model_state_bytes
from lightning_zero.models.gpt import GPT, Block, GPTConfig
from lightning_zero.models.param_groups import param_groups_with_weight_decay
from lightning_zero.sharding.flat_bucket import build_buckets

Precision = Literal["bf16", "fp16", "fp32"]
PARAM_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4}
STAGES = (0, 1, 2, 3)
STAGE_LABELS = {0: "DDP", 1: "1", 2: "2", 3: "3"}
FORMULAS = {0: "(2+2+K)Ψ", 1: "(2+2)Ψ + KΨ/N", 2: "2Ψ + (2+K)Ψ/N", 3: "(2+2+K)Ψ/N"}
COLLECTIVES = {0: "all-reduce 2Ψ(N-1)/N", 1: "RS + AG 2Ψ(N-1)/N", 2: "RS + AG 2Ψ(N-1)/N", 3: "AG×2 + RS 3Ψ(N-1)/N"}
DEFAULT_CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


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


class StageEstimate(NamedTuple):
    """One stage's numbers for one rank."""

    stage: int
    """0 for DDP."""
    state: ModelStateBytes
    """Bytes this rank holds (the partitioner's layout in ``--model`` mode, the formula otherwise)."""
    formula: ModelStateBytes
    """The ZeRO paper's formula for the same model and N."""
    sent: int
    """Bytes this rank sends per optimizer step."""
    units: int
    """Flat buckets (stages 1-2) or gather units (stage 3) the parameters are packed into; 0 for the formula."""
    padding: int
    """Elements of padding this rank holds in its shards (each bucket or unit is padded to a multiple of N)."""


# -- the formula -------------------------------------------------------------------------------------------------------
def paper_estimates(num_params: int, world_size: int, precisions: Precisions) -> list[StageEstimate]:
    """Every stage by the ZeRO paper's formula: model state and bytes sent per step by each rank."""
    n = world_size
    out = []
    for stage in STAGES:
        formula = _formula(num_params, n, stage, precisions)
        # DDP and stages 1-2 move 2Ψ(N-1)/N elements per step; stage 3 gathers parameters twice (forward, backward).
        elements = (3 if stage == 3 else 2) * num_params * (n - 1) // n
        out.append(StageEstimate(stage, formula, formula, elements * precisions.param, 0, 0))
    return out


def _formula(num_params: int, world_size: int, stage: int, p: Precisions) -> ModelStateBytes:
    return expected_model_state_bytes(num_params, world_size, stage, p.param, p.master, p.optimizer)


# -- the partitioner ---------------------------------------------------------------------------------------------------
def build_meta_gpt(config: GPTConfig) -> GPT:
    """The GPT on the ``meta`` device: every shape, no storage."""
    with torch.device("meta"):
        return GPT(config)


def stage3_units(model: nn.Module) -> list[list[tuple[str, nn.Parameter]]]:
    """Stage 3's gather units: one per transformer ``Block``, then a root unit with every other parameter.

    The only place that decides stage-3 units here, so that it can be switched to the stage-3 strategy's own
    partitioner without touching the rest.
    """
    names = {id(p): fqn for fqn, p in model.named_parameters()}
    units: list[list[tuple[str, nn.Parameter]]] = []
    in_block: set[int] = set()
    for module in model.modules():
        if isinstance(module, Block):
            params = [p for p in module.parameters() if id(p) not in in_block]
            in_block.update(id(p) for p in params)
            units.append([(names[id(p)], p) for p in params])
    units.append([(names[id(p)], p) for p in model.parameters() if id(p) not in in_block])
    return [u for u in units if u]


def simulated_estimates(
    config: GPTConfig, world_size: int, precisions: Precisions, bucket_numel: int
) -> list[StageEstimate]:
    """Every stage as the partitioner lays the model out on rank 0 of ``world_size`` (exact, padding included)."""
    n = world_size
    p = precisions
    model = build_meta_gpt(config)
    num_params = sum(t.numel() for t in model.parameters())
    ddp = _formula(num_params, n, 0, p)  # DDP has no layout of its own: the formula is exact
    out = [StageEstimate(0, ddp, ddp, 2 * num_params * (n - 1) // n * p.param, 0, 0)]

    # Stages 1 and 2: the optimizer's param groups packed into flat buckets, each padded to a multiple of N.
    names = {id(t): fqn for fqn, t in model.named_parameters()}
    groups = [[(names[id(t)], t) for t in g["params"]] for g in param_groups_with_weight_decay(model, 0.1)]
    buckets = build_buckets(groups, bucket_numel, 0, n, list(model.parameters()))
    padded = sum(b.padded_numel for b in buckets)
    shard = sum(b.shard_numel for b in buckets)
    optimizer = ModelStateBytes(0, 0, shard * p.master, shard * p.optimizer)
    # Parameters are views into the full padded buffers; stage 1 keeps full padded gradients, stage 2 its shard.
    stage1 = ModelStateBytes(padded * p.param, padded * p.param, optimizer.master_weights, optimizer.optimizer_state)
    stage2 = stage1._replace(gradients=shard * p.param)
    sent = 2 * shard * (n - 1) * p.param  # reduce-scatter + all-gather of the padded buffers
    for stage, state in ((1, stage1), (2, stage2)):
        out.append(
            StageEstimate(stage, state, _formula(num_params, n, stage, p), sent, len(buckets), shard * n - num_params)
        )

    # Stage 3: every unit is one flat buffer padded to a multiple of N; this rank keeps a shard of each.
    units = stage3_units(model)
    shard3 = sum(math.ceil(sum(t.numel() for _, t in unit) / n) for unit in units)
    state3 = ModelStateBytes(shard3 * p.param, shard3 * p.param, shard3 * p.master, shard3 * p.optimizer)
    sent3 = 3 * shard3 * (n - 1) * p.param  # all-gather in forward and in backward, reduce-scatter of gradients
    out.append(StageEstimate(3, state3, _formula(num_params, n, 3, p), sent3, len(units), shard3 * n - num_params))
    return out


def load_model_config(name: str, conf_dir: Path = DEFAULT_CONF_DIR) -> GPTConfig:
    """``GPTConfig`` of ``conf/model/<name>.yaml``, composed by Hydra exactly as the example composes it."""
    from hydra import compose, initialize_config_dir

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
    fields = {k: v for k, v in cfg.model.config.items() if k != "_target_"}
    return GPTConfig(**fields)


# -- showing -----------------------------------------------------------------------------------------------------------
def _unit(largest: int) -> tuple[str, float]:
    """Decimal units, as the paper counts; GB unless the whole table is smaller."""
    for name, scale in (("GB", 1e9), ("MB", 1e6)):
        if largest >= scale:
            return name, scale
    return "kB", 1e3


def format_estimates(estimates: Sequence[StageEstimate], exact: bool) -> str:
    """A table, one row per stage. ``exact``: also the partitioner's bytes, to the byte, and its padding."""
    unit, scale = _unit(max(max(e.state.total, e.sent) for e in estimates))
    header = [f"{h} {unit}" for h in ("params", "grads", "optim(K)", "total", "sent/step")]
    header.insert(0, "stage")
    if exact:
        header += ["total bytes", "formula bytes", "units", "padding", "sent/step bytes"]
    header += ["formula", "collectives"]
    rows = []
    for e in estimates:
        s = e.state
        values = (s.parameters, s.gradients, s.master_weights + s.optimizer_state, s.total, e.sent)
        row = [STAGE_LABELS[e.stage], *(f"{v / scale:.1f}" for v in values)]
        if exact:
            row += [f"{s.total:,}", f"{e.formula.total:,}", str(e.units or "-"), f"{e.padding:,}", f"{e.sent:,}"]
        row += [FORMULAS[e.stage], COLLECTIVES[e.stage]]
        rows.append(row)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    text_columns = len(header) - 2  # the last two are words: left-aligned

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i >= text_columns else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return "\n".join([line(header), *(line(r) for r in rows)])


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
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=_parse_count, help="number of parameters Ψ, e.g. 7.5e9 (the formula)")
    what.add_argument("--model", help="a config name from conf/model/, e.g. gpt7b (the real partitioner)")
    parser.add_argument("--gpus", type=_parse_count, required=True, help="data-parallel ranks N")
    parser.add_argument(
        "--precision", choices=sorted(PARAM_BYTES), default="bf16", help="parameters and gradients (default: bf16)"
    )
    parser.add_argument(
        "-K",
        "--optimizer-bytes",
        type=int,
        default=None,
        metavar="K",
        help="optimizer-state bytes per parameter, fp32 master copy included (default: 12 = Adam with a 4-byte "
        "master for 16-bit parameters, 8 for fp32 parameters)",
    )
    parser.add_argument("--bucket-numel", type=_parse_count, default=4_000_000, help="ZeroConfig.bucket_numel")
    parser.add_argument("--config-dir", type=Path, default=DEFAULT_CONF_DIR, help="the conf/ directory")
    parser.add_argument("--plot", type=Path, default=None, help="also write a PNG bar chart (needs matplotlib)")
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        precisions = Precisions.of(args.precision, args.optimizer_bytes)
        n = args.gpus
        if args.model is None:
            num_params = args.params
            estimates = paper_estimates(num_params, n, precisions)
            title = f"Ψ = {num_params:,} parameters"
        else:
            config = load_model_config(args.model, args.config_dir)
            estimates = simulated_estimates(config, n, precisions, args.bucket_numel)
            num_params = sum(t.numel() for t in build_meta_gpt(config).parameters())
            title = f"{args.model}: Ψ = {num_params:,} parameters"
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    k = precisions.k
    print(f"{title} on N = {n:,} ranks; {args.precision} parameters and gradients ({precisions.param} bytes), K = {k}")
    if args.model is None:
        print("Model-state memory per rank by the ZeRO paper's formula (decimal units: 1 GB = 10^9 bytes):\n")
    else:
        print(
            f"Model-state memory of rank 0 as the partitioner lays it out (bucket_numel = {args.bucket_numel:,}; "
            "stage 3: one unit per transformer block plus a root unit), padding included:\n"
        )
    print(format_estimates(estimates, exact=args.model is not None))
    if args.plot is not None:
        from lightning_zero.lightning.report import plot_memory_by_stage

        bars = {("DDP" if e.stage == 0 else f"ZeRO-{e.stage}"): e.state for e in estimates}
        plot_memory_by_stage(bars, args.plot, f"{title} on {n:,} ranks, {args.precision}, K = {k}")
        print(f"\nchart written to {args.plot}")
    return 0
