"""How far ZeRO++'s quantized collectives move training from plain stage 3, and why: 4 ranks as 2 nodes x 2.

    .venv/bin/python benchmarks/zeropp_accuracy.py errors --steps 60 --out benchmarks/results/zeropp_errors.json
    .venv/bin/python benchmarks/zeropp_accuracy.py seeds --steps 300 --seeds 0,1,2 --optimizers adamw,sgd \\
        --runs "stage 3 + ZeRO++" --out benchmarks/results/zeropp_seeds.json

``errors`` trains the example GPT (``--model``, tiny by default) through the Trainer exactly as
``benchmarks/zeropp_gpt.py`` does, with stage 3's collectives shadowed: at every bucket's reduce-scatter and every
unit's all-gather, each rank also runs the exact fp32 collective and each quantized variant (``--grad-variants``,
``--weight-variants``) on the same input, and records per bucket how the quantized result differs from the exact
one. Training follows the run's own collectives (``--follow``: plain stage 3, or every ZeRO++ switch on), so the
statistics are taken at the weights and data of that trajectory. Per variant, over buckets and steps:

* ``rel_err``: ``|q - e| / |e|`` (norms over the bucket, all ranks' shards);
* ``gain``: ``<q, e> / <e, e>``, the part of ``e`` that ``q`` keeps (1: no shrinkage), and ``norm_ratio``
  ``|q| / |e|``;
* ``bias``: ``mean(q - e) / rms(e)``, a shift of the mean;
* ``zeroed``: the fraction of nonzero exact elements that come back as 0;
* ``persistence``: ``|sum_t (q_t - e_t)|^2 / sum_t |q_t - e_t|^2`` per element over the steps, which is about 1
  when the errors of successive steps are independent and grows to the number of steps when the same error repeats
  (a systematic effect); reported beside the same ratio of the exact gradients themselves ("gradient itself");
* ``shrunk``: the fraction of elements whose gain over the steps, ``sum_t q_t e_t / sum_t e_t^2``, is below 1/2.

``seeds`` runs plain stage 3 and each of ``--runs`` for every seed (initial weights and batch order) and optimizer
(AdamW at lr 3e-3, or SGD with momentum 0.9 at lr 0.1, ``tests.zeropp_runs.OPTIMIZERS``) and reports the final loss
(mean over the last ``--loss-window`` steps and the 4 ranks) and its gap to plain stage 3 per seed, with their mean
and spread.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import Tensor  # noqa: E402
from typing_extensions import override  # noqa: E402

from lightning_zero import ZeroStrategy  # noqa: E402
from lightning_zero.comm.collectives import ProcessGroup, all_gather, reduce_scatter  # noqa: E402
from lightning_zero.comm.hierarchical_reduce import HierarchicalReduceScatter  # noqa: E402
from lightning_zero.comm.pending_collective import PendingCollective  # noqa: E402
from lightning_zero.comm.quantized_all_gather import quantized_all_gather  # noqa: E402
from lightning_zero.comm.streams import CollectiveStream  # noqa: E402
from lightning_zero.comm.topology import build_node_groups  # noqa: E402
from lightning_zero.sharding.flat_bucket import FlatBucket  # noqa: E402
from lightning_zero.stage3.secondary_shard import PlainGather  # noqa: E402
from tests import zeropp_runs  # noqa: E402
from tests.harness import run_distributed  # noqa: E402

PLAIN = {"ranks_per_node": 2}
EVERYTHING = {**PLAIN, "quantize_weights": True, "hpz_partition_size": 2, "quantize_gradients": True}
RUNS: dict[str, dict[str, Any]] = {
    "stage 3": PLAIN,
    "stage 3 again": PLAIN,
    "stage 3 fp32 reduce-scatter": {**PLAIN, "reduce_dtype": "float32"},
    "stage 3 + ZeRO++": EVERYTHING,
    "qwZ only": {**PLAIN, "quantize_weights": True},
    "qgZ only": {**PLAIN, "quantize_gradients": True},
    "ZeRO++ block 256": {**EVERYTHING, "quantization_block": 256},
    "ZeRO++ block 64": {**EVERYTHING, "quantization_block": 64},
    "ZeRO++ qgZ int8": {**EVERYTHING, "gradient_quantization_bits": 8},
}
_SUMS = ("ee", "qq", "qe", "d", "n", "zeroed", "nonzero")


def _variant(spec: str) -> tuple[int, int]:
    bits, block = spec.split("/")
    return int(bits.removeprefix("int")), int(block)


@dataclass
class _Accumulated:
    """One variant and bucket, over this rank's shard, summed over the steps."""

    error: Tensor
    """Per element, sum_t (q_t - e_t)."""
    error_squares: float
    """sum_t |q_t - e_t|^2."""
    qe: Tensor
    """Per element, sum_t q_t e_t."""
    ee: Tensor
    """Per element, sum_t e_t^2."""


class _Stats:
    """Per variant and bucket: the sums of every step (reduced over ranks) and the per-element sums over steps
    (this rank's shard)."""

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group
        self.sums: dict[tuple[str, int], list[list[float]]] = {}
        self.accumulated: dict[tuple[str, int], _Accumulated] = {}

    def add(self, variant: str, bucket: int, q: Tensor, e: Tensor) -> None:
        """Record one step's quantized ``q`` against the exact ``e`` (this rank's part of the bucket)."""
        q, e = q.double().reshape(-1), e.double().reshape(-1)
        d = q - e
        local = torch.stack(
            [
                e.dot(e),
                q.dot(q),
                q.dot(e),
                d.sum(),
                torch.tensor(float(e.numel()), dtype=torch.float64),
                ((q == 0) & (e != 0)).sum().double(),
                (e != 0).sum().double(),
            ]
        )
        dist.all_reduce(local, group=self.group)
        self.sums.setdefault((variant, bucket), []).append(local.tolist())
        zeros = torch.zeros_like(d)
        acc = self.accumulated.setdefault((variant, bucket), _Accumulated(zeros, 0.0, zeros, zeros))
        acc.error = acc.error + d
        acc.error_squares += float(d.dot(d))
        acc.qe = acc.qe + q * e
        acc.ee = acc.ee + e * e

    def persistence(self) -> dict[tuple[str, int], dict[str, float]]:
        """Per key, ``|sum_t d_t|^2 / sum_t |d_t|^2`` over every rank's shard, and the fraction of elements whose
        gain over the steps ``sum_t q_t e_t / sum_t e_t^2`` is below 1/2 (elements that the quantizer shrinks step
        after step, which Adam's per-element normalization makes count as much as any)."""
        out = {}
        for key in sorted(self.accumulated):
            acc = self.accumulated[key]
            live = acc.ee > 0
            gain = acc.qe[live] / acc.ee[live]
            local = [float(acc.error.dot(acc.error)), acc.error_squares, float((gain < 0.5).sum()), float(live.sum())]
            sums = torch.tensor(local, dtype=torch.float64)
            dist.all_reduce(sums, group=self.group)
            out[key] = {
                "persistence": float(sums[0] / sums[1]) if sums[1] > 0 else math.nan,
                "shrunk": float(sums[2] / sums[3]) if sums[3] > 0 else math.nan,
            }
        return out


class _ShadowReduceScatter:
    """Runs the exact fp32 reduce-scatter and each quantized variant on a bucket's input, records how they differ,
    then the run's own reduce-scatter (whose result training uses)."""

    def __init__(
        self,
        own: Callable[..., PendingCollective],
        stats: _Stats,
        variants: list[str],
        intra: ProcessGroup,
        inter: ProcessGroup,
    ) -> None:
        self.own = own
        self.stats = stats
        self.variants = {v: HierarchicalReduceScatter(intra, inter, *_variant(v)) for v in variants}  # type: ignore[arg-type]
        self.bucket = -1

    def __call__(self, output: Tensor, input: Tensor, group: ProcessGroup, **kwargs: Any) -> PendingCollective:
        exact = torch.empty(output.numel(), dtype=torch.float32)
        reduce_scatter(exact, input.float(), group).wait()
        self.stats.add("gradient itself", self.bucket, 2 * exact, exact)  # q - e = e: the persistence of e
        for name, comm in self.variants.items():
            q = torch.empty_like(output)
            comm(q, input.clone(), group).wait()
            self.stats.add(name, self.bucket, q, exact)
        bf16 = torch.empty_like(output)
        reduce_scatter(bf16, input.clone(), group).wait()
        self.stats.add(f"exact {output.dtype}".replace("torch.", ""), self.bucket, bf16, exact)
        pending = self.own(output, input, group, **kwargs)
        pending.wait()
        self.stats.add("used", self.bucket, output, exact)
        return pending


class _ShadowGather(PlainGather):
    """Runs the exact all-gather and each int8 variant of a bucket's shards, records how they differ, then the run's
    own gather."""

    def __init__(self, own: PlainGather, stats: _Stats, variants: list[int], index: dict[int, int]) -> None:
        self.own = own
        self.stats = stats
        self.variants = variants
        self.index = index

    @override
    def gather(
        self, bucket: FlatBucket, flat: Tensor, group: ProcessGroup, stream: CollectiveStream | None = None
    ) -> PendingCollective:
        exact = torch.empty_like(flat)
        all_gather(exact, bucket.param_shard.clone(), group).wait()
        number = self.index[id(bucket)]
        for block in self.variants:
            q = torch.empty_like(flat)
            quantized_all_gather(q, bucket.param_shard.clone(), group, block).wait()
            self.stats.add(f"int8/{block}", number, _mine(q, group), _mine(exact, group))
        pending = self.own.gather(bucket, flat, group, stream)
        pending.wait()
        self.stats.add("used", number, _mine(flat, group), _mine(exact, group))
        return pending

    @override
    def secondary_bytes(self) -> int:
        return self.own.secondary_bytes()


def _mine(flat: Tensor, group: ProcessGroup) -> Tensor:
    """This rank's 1/N of a gathered buffer (so that the sums over ranks count each element once)."""
    return flat.view(group.size(), -1)[dist.get_rank(group)]


class ShadowCollectives(pl.Callback):
    """Installs the shadows once the strategy has sharded the model (Note in the module docstring)."""

    def __init__(self, grad_variants: list[str], weight_variants: list[int]) -> None:
        self.grad_variants = grad_variants
        self.weight_variants = weight_variants
        self.grads: _Stats | None = None
        self.weights: _Stats | None = None

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, ZeroStrategy)
        assert strategy._gatherer is not None
        gatherer = strategy._gatherer
        group = gatherer.reducer.group
        ranks = dist.get_process_group_ranks(group)
        nodes = build_node_groups(ranks, 2, timedelta(seconds=600), with_inter=True)
        assert nodes.inter is not None
        self.grads, self.weights = _Stats(group), _Stats(group)
        reducer = gatherer.reducer
        shadow = _ShadowReduceScatter(reducer.reduce_scatter, self.grads, self.grad_variants, nodes.intra, nodes.inter)
        index = {id(b): i for i, b in enumerate(gatherer.all_buckets())}
        reducer.reduce_scatter = shadow
        inner = reducer._reduce_scatter

        def tagged(bucket: FlatBucket, output: Tensor, input: Tensor) -> PendingCollective:
            shadow.bucket = index[id(bucket)]
            return inner(bucket, output, input)

        reducer._reduce_scatter = tagged  # type: ignore[method-assign]
        gathers: dict[int, _ShadowGather] = {}
        for unit in gatherer.units:
            own = unit.gather_comm
            if id(own) not in gathers:
                gathers[id(own)] = _ShadowGather(own, self.weights, self.weight_variants, index)
            unit.gather_comm = gathers[id(own)]


def _summarize(stats: _Stats) -> dict[str, Any]:
    """Per variant: the statistics over every bucket and step (sums pooled), and per bucket."""
    persistence = stats.persistence()
    out: dict[str, Any] = {}
    for variant in sorted({v for v, _ in stats.sums}):
        per_bucket = {}
        pooled = [0.0] * len(_SUMS)
        for (v, bucket), steps in sorted(stats.sums.items()):
            if v != variant:
                continue
            totals = [sum(col) for col in zip(*steps, strict=True)]
            pooled = [a + b for a, b in zip(pooled, totals, strict=True)]
            per_bucket[bucket] = {**_ratios(totals), **persistence[(v, bucket)], "steps": len(steps)}
        out[variant] = {"all": _ratios(pooled), "buckets": per_bucket}
    return out


def _ratios(sums: list[float]) -> dict[str, float]:
    s = dict(zip(_SUMS, sums, strict=True))
    ee, qq, qe = s["ee"], s["qq"], s["qe"]
    dd = qq - 2 * qe + ee
    return {
        "rel_err": math.sqrt(max(dd, 0.0) / ee) if ee else math.nan,
        "gain": qe / ee if ee else math.nan,
        "norm_ratio": math.sqrt(qq / ee) if ee else math.nan,
        "bias": (s["d"] / s["n"]) / math.sqrt(ee / s["n"]) if ee else math.nan,
        "zeroed": s["zeroed"] / s["nonzero"] if s["nonzero"] else math.nan,
        "elements": s["n"],
    }


def measure_errors(
    zero: dict[str, Any], steps: int, root: str, model: str, grad_variants: list[str], weight_variants: list[int]
) -> dict[str, Any]:
    """In a rank: train with the shadows installed; the statistics of gradients and weights (rank 0's copy)."""
    shadows = ShadowCollectives(grad_variants, weight_variants)
    result = zeropp_runs.fit_gpt(zero, steps, root, model, callbacks=[shadows])
    assert shadows.grads is not None
    assert shadows.weights is not None
    return {"losses": result["losses"], "grads": _summarize(shadows.grads), "weights": _summarize(shadows.weights)}


def fit_runs(
    zeros: list[dict[str, Any]], steps: int, root: str, model: str, seed: int, optimizer: str, lr: float | None = None
) -> list[Any]:
    """In a rank: ``fit_gpt`` for each of ``zeros`` in turn; every run's per-step losses."""
    return [
        zeropp_runs.fit_gpt(zero, steps, root, model, seed=seed, optimizer=optimizer, lr=lr)["losses"] for zero in zeros
    ]


def _print_errors(name: str, summary: dict[str, Any]) -> None:
    print(f"\n{name}: pooled over buckets and steps")
    print("| variant | rel_err | gain <q,e>/<e,e> | norm ratio | bias mean(q-e)/rms(e) | zeroed |")
    print("|---|---|---|---|---|---|")
    for variant, s in summary.items():
        a = s["all"]
        print(
            f"| {variant} | {a['rel_err']:.4f} | {a['gain']:.4f} | {a['norm_ratio']:.4f} | {a['bias']:+.2e} "
            f"| {a['zeroed']:.3f} |"
        )
    print(f"\n{name}: per bucket (rel_err / gain / persistence / shrunk)")
    variants = list(summary)
    buckets = sorted({b for s in summary.values() for b in s["buckets"]})
    print("| bucket | elements | " + " | ".join(variants) + " |")
    print("|---|---|" + "---|" * len(variants))
    for b in buckets:
        cells = []
        elements = 0.0
        for v in variants:
            r = summary[v]["buckets"].get(b)
            if r is None:
                cells.append("")
                continue
            elements = r["elements"] / r["steps"]
            cells.append(f"{r['rel_err']:.3f} / {r['gain']:.3f} / {r['persistence']:.1f} / {r['shrunk']:.3f}")
        print(f"| {b} | {elements:.0f} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    errors = sub.add_parser("errors")
    errors.add_argument("--follow", choices=["stage 3", "stage 3 + ZeRO++"], default="stage 3")
    errors.add_argument("--grad-variants", default="int4/2048,int8/2048,int4/256,int4/64")
    errors.add_argument("--weight-variants", default="2048,256")
    seeds = sub.add_parser("seeds")
    seeds.add_argument("--seeds", default="0,1,2")
    seeds.add_argument("--optimizers", default="adamw,sgd")
    seeds.add_argument("--runs", default="stage 3 + ZeRO++", help=f"compared with stage 3, of: {', '.join(RUNS)}")
    seeds.add_argument("--loss-window", type=int, default=20)
    seeds.add_argument("--lr", type=float, default=None, help="instead of each optimizer's default learning rate")
    for p in (errors, seeds):
        p.add_argument("--steps", type=int, default=60)
        p.add_argument("--model", choices=["small", "tiny"], default="tiny")
        p.add_argument("--timeout", type=float, default=7200.0)
        p.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.command == "errors":
        _errors(args)
    else:
        _seeds(args)


def _errors(args: argparse.Namespace) -> None:
    from benchmarks import zeropp_accuracy as this  # rank functions must be importable by name

    grad_variants = args.grad_variants.split(",")
    weight_variants = [int(b) for b in args.weight_variants.split(",")]
    with tempfile.TemporaryDirectory() as root:
        ranks = run_distributed(
            this.measure_errors, 4, RUNS[args.follow], args.steps, root, args.model, grad_variants, weight_variants,
            init_process_group=False, timeout=args.timeout, collective_timeout=600,
        )  # fmt: skip
    result = ranks[0]  # every rank holds the same reduced statistics
    print(f"following {args.follow}, {args.steps} steps, {args.model} GPT")
    _print_errors("gradients (reduce-scatter)", result["grads"])
    _print_errors("weights (all-gather)", result["weights"])
    if args.out is not None:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **result}, indent=1))


def _seeds(args: argparse.Namespace) -> None:
    from benchmarks import zeropp_accuracy as this  # rank functions must be importable by name

    names = [n.strip() for n in args.runs.split(",")]
    zeros = [RUNS["stage 3"]] + [RUNS[n] for n in names]
    table: dict[str, Any] = {}
    for optimizer in args.optimizers.split(","):
        for seed in [int(s) for s in args.seeds.split(",")]:
            with tempfile.TemporaryDirectory() as root:
                ranks = run_distributed(
                    this.fit_runs, 4, zeros, args.steps, root, args.model, seed, optimizer, args.lr,
                    init_process_group=False, timeout=args.timeout, collective_timeout=600,
                )  # fmt: skip
            finals = [
                statistics.fmean(loss for rank in ranks for loss in rank[run][-args.loss_window :])
                for run in range(len(zeros))
            ]
            curves = [
                [statistics.fmean(rank[run][s] for rank in ranks) for s in range(args.steps)]
                for run in range(len(zeros))
            ]
            table[f"{optimizer} seed {seed}"] = {
                "final": dict(zip(["stage 3", *names], finals, strict=True)),
                "curves": curves,
            }
            changes = ", ".join(f"{n} {f / finals[0] - 1:+.2%}" for n, f in zip(names, finals[1:], strict=True))
            print(
                f"{optimizer} seed {seed}: stage 3 {finals[0]:.4f}; "
                + ", ".join(f"{n} {f:.4f}" for n, f in zip(names, finals[1:], strict=True))
                + f" ({changes})",
                flush=True,
            )
    print("\n| optimizer | run | gap per seed | mean | spread (sd) |")
    print("|---|---|---|---|---|")
    for optimizer in args.optimizers.split(","):
        for n in names:
            gaps = [
                r["final"][n] / r["final"]["stage 3"] - 1 for k, r in table.items() if k.startswith(optimizer + " ")
            ]
            sd = statistics.stdev(gaps) if len(gaps) > 1 else math.nan
            per_seed = " / ".join(f"{g:+.2%}" for g in gaps)
            print(f"| {optimizer} | {n} | {per_seed} | {statistics.fmean(gaps):+.2%} | {sd:.2%} |")
    if args.out is not None:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": table}, indent=1))


if __name__ == "__main__":
    main()
