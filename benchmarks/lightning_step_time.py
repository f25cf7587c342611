"""Step time and peak memory of a ~25M GPT trained through ``lightning.pytorch.Trainer`` under several strategies.

    .venv/bin/python benchmarks/lightning_step_time.py --world-size 2 --steps 20 --warmup 5 --batch-size 4 \\
        --repeats 3 --out benchmarks/results/lightning_step_time.json

The Lightning-level counterpart of ``step_time.py``: the same model (``GPTConfig.bench25m()``, seq 128, fp32) as
``lightning_zero.models.LitGPT`` (its AdamW: weight decay 0.1 on matrices, none on biases and norms), trained by a
``Trainer`` under each strategy, side by side in one run:

- ``ddp``: Lightning's ``DDPStrategy`` (the ``"ddp"`` preset);
- ``zero1``, ``zero2``, ``zero3``: ``lightning_zero``'s presets; stage 3 builds ``configure_model`` on the meta
  device and materializes it unit by unit in ``setup`` (sharded init: no rank ever holds the whole model);
- ``fsdp2``: Lightning's ``ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1)``, with
  ``fully_shard`` applied to every transformer ``Block`` and then to the root GPT in ``configure_model``, on the
  strategy's ``"data_parallel"`` mesh (the way Lightning 2.6 expects it; it runs on the CPU with gloo).

Every variant starts from the same weights (``torch.manual_seed(--seed)`` in ``configure_model``; stage 3 draws the
same numbers when it materializes) and trains on the same batches: random tokens, drawn per rank from a generator
seeded with the rank (``use_distributed_sampler=False``). The last step's loss is printed and must agree.

Processes: each variant runs on ``--world-size`` fresh ``spawn``-ed gloo ranks (``_common.run_ranks``: peak RSS is
the variant's own, one compute thread each, ``MALLOC_MMAP_THRESHOLD_=65536``; ``--mmap-threshold 0`` leaves glibc's
default, and peak RSS is then not meaningful). The process group already exists when the ``Trainer`` is built, and
``LOCAL_RANK``/``NODE_RANK`` are set with a ``LightningEnvironment``, so Lightning treats the ranks as launched by
someone else: its launcher starts no process (checked in every rank) and it joins the existing group.

Timing: a callback times each step from ``on_train_batch_start`` (after a barrier, so that the ranks start
together) to ``on_train_batch_end`` (forward, backward and optimizer step, with Lightning's own per-step work);
``--warmup`` untimed steps, then ``--steps`` timed ones. A step's time is its slowest rank's; a run's figure is the
median over the timed steps; ``--repeats R`` runs the variants round-robin R times and the table shows the median
of the repeats and every repeat, with ratios to DDP and to FSDP2. CPU time per step (all threads of a rank) and peak
RSS per rank (``VmHWM``) are reported too. No logger, checkpointing, progress bar, model summary or validation. The
machine-wide contention probe, ``--idle-wait``, ``--max-other-cores`` and ``--attempts`` work as in
``step_time.py``. ``lightning_zero``'s strategy also runs its fault monitor's heartbeat thread (a store write every
2 s), as it does for any user.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import _common as bench
import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments.lightning import LightningEnvironment
from lightning.pytorch.strategies import ModelParallelStrategy, ParallelStrategy, Strategy
from torch import Tensor
from torch.utils.data import DataLoader
from typing_extensions import override

import lightning_zero  # noqa: F401  # registers the "zero1".."zero3" strategy presets
from lightning_zero.models import GPT, GPTConfig, LitGPT

MiB = 2**20
VARIANTS = ("ddp", "zero1", "zero2", "zero3", "fsdp2")
Batch = tuple[Tensor, Tensor]


@dataclass(frozen=True)
class BenchArgs:
    """Command-line arguments shared by every rank (each field is a ``--flag``)."""

    world_size: int = 2
    steps: int = 20
    """Timed steps per variant."""
    warmup: int = 5
    """Untimed steps before them."""
    batch_size: int = 4
    """Sequences of ``block_size`` (128) tokens per rank and step."""
    lr: float = 3e-4
    seed: int = 1234


class BenchGPT(LitGPT):
    """``LitGPT`` on this rank's random batches, without logging; under ``fsdp2`` its ``configure_model`` also
    applies ``fully_shard``."""

    def __init__(self, args: BenchArgs, rank: int, fsdp2: bool) -> None:
        super().__init__(GPTConfig.bench25m(), lr=args.lr)
        self.args, self.rank, self.fsdp2 = args, rank, fsdp2
        self.built_on_meta = False

    @override
    def configure_model(self) -> None:
        if self.model is not None:
            return
        torch.manual_seed(self.args.seed)  # the same initial weights in every variant (stage 3 draws them in setup)
        super().configure_model()
        self.built_on_meta = any(p.is_meta for p in self.gpt.parameters())
        if self.fsdp2:
            from torch.distributed.fsdp import fully_shard

            assert self.device_mesh is not None
            mesh = self.device_mesh["data_parallel"]
            for block in self.gpt.blocks:  # one unit per block, as our stage 3's default policy, plus the root
                fully_shard(block, mesh=mesh)
            fully_shard(self.gpt, mesh=mesh)

    @override
    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        inputs, targets = batch
        return self.gpt.loss(inputs, targets)  # no self.log: nothing but the step itself is timed

    @override
    def train_dataloader(self) -> DataLoader[Batch]:
        gen = torch.Generator().manual_seed(self.args.seed * 1000 + self.rank)  # own data per rank, same per variant
        shape = (self.args.warmup + self.args.steps, self.args.batch_size, self.config.block_size + 1)
        tokens = torch.randint(self.config.vocab_size, shape, generator=gen)
        batches: list[Batch] = [(t[:, :-1], t[:, 1:]) for t in tokens]
        return DataLoader(batches, batch_size=None)  # type: ignore[arg-type]  # a list is a map-style dataset


class StepTimer(pl.Callback):
    """Wall and CPU time of every training step (forward, backward, optimizer step) and its loss, on this rank."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.losses: list[float] = []
        self._start = self._cpu_start = 0.0

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        dist.barrier()
        self._start, self._cpu_start = time.perf_counter(), time.process_time()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        self.times.append(time.perf_counter() - self._start)
        self.cpu_times.append(time.process_time() - self._cpu_start)  # all threads of this rank, gloo's included
        self.losses.append(float(outputs["loss"]))


def make_strategy(variant: str, world: int) -> str | Strategy:
    if variant == "fsdp2":  # "auto" would make every rank a tensor-parallel rank: here all N are data-parallel
        return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    return variant


def bench_rank(rank: int, world: int, variant: str, args: BenchArgs) -> dict[str, Any]:
    """Runs on every (already spawned, already joined) rank: fit ``warmup + steps`` steps, report timings and
    memory."""
    baseline = bench.memory_status()
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # "GPU available: False", ...
    for noise in (r".*does not have many workers", r"You defined a `validation_step`", r"`isinstance\(treespec"):
        warnings.filterwarnings("ignore", message=noise)  # Lightning's own, nothing this benchmark can act on
    # Lightning's LightningEnvironment reads these: with LOCAL_RANK set, the processes "exist already" and its
    # launcher starts none; the process group _common created is reused by every strategy.
    os.environ.update({"LOCAL_RANK": str(rank), "NODE_RANK": "0"})
    timer = StepTimer()
    module = BenchGPT(args, rank, fsdp2=variant == "fsdp2")
    trainer = pl.Trainer(
        strategy=make_strategy(variant, world),
        accelerator="cpu",
        devices=world,
        num_nodes=1,
        plugins=[LightningEnvironment()],
        precision="32-true",
        max_steps=args.warmup + args.steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    )
    strategy = trainer.strategy
    assert isinstance(strategy, ParallelStrategy)
    launcher, env = strategy.launcher, strategy.cluster_environment
    if launcher is not None and not (env is not None and env.creates_processes_externally):
        raise RuntimeError(f"{type(launcher).__name__} would start new processes under {type(env).__name__}")
    trainer.fit(module)
    children = getattr(launcher, "procs", [])
    if children or trainer.global_rank != rank or trainer.world_size != world:
        raise RuntimeError(
            f"Lightning did not run in the spawned ranks: launched {len(children)} processes, "
            f"trainer rank {trainer.global_rank}/{trainer.world_size} in rank {rank}/{world}"
        )
    if len(timer.times) != args.warmup + args.steps:
        raise RuntimeError(f"{len(timer.times)} steps timed, expected {args.warmup + args.steps}")
    return {
        "times": timer.times,
        "cpu_times": timer.cpu_times,
        "losses": timer.losses,
        "memory": bench.memory_status(),
        "baseline_memory": baseline,
        "mmap_threshold_active": bench.mmap_threshold_active(),
        "num_threads": torch.get_num_threads(),
        "launcher": type(launcher).__name__ if launcher is not None else None,
        "cluster_environment": type(env).__name__,
        "strategy": type(trainer.strategy).__name__,
        "built_on_meta": module.built_on_meta,
    }


def aggregate(per_repeat: list[list[dict[str, Any]]], warmup: int) -> dict[str, Any]:
    """Per-repeat results (each a list over ranks) -> one variant's summary."""
    medians = []
    for ranks in per_repeat:
        slowest = [max(r["times"][i] for r in ranks) for i in range(warmup, len(ranks[0]["times"]))]
        medians.append(statistics.median(slowest))
    ranks = per_repeat[-1]
    world = len(ranks)
    return {
        "step_time_s": {**bench.summarize(medians), "per_repeat": medians},
        "cpu_time_s": statistics.median(t for rs in per_repeat for r in rs for t in r["cpu_times"][warmup:]),
        "peak_rss_bytes": max(r["memory"]["VmHWM"] for rs in per_repeat for r in rs),
        "peak_rss_per_rank_bytes": [max(rs[i]["memory"]["VmHWM"] for rs in per_repeat) for i in range(world)],
        "peak_ru_maxrss_bytes": max(r["memory"]["ru_maxrss"] for rs in per_repeat for r in rs),
        "baseline_rss_bytes": max(r["baseline_memory"]["VmRSS"] for rs in per_repeat for r in rs),
        "last_loss": statistics.fmean(r["losses"][-1] for r in ranks),
        "mmap_threshold_active": all(r["mmap_threshold_active"] for rs in per_repeat for r in rs),
        "other_cpu_cores": [rs[0]["other_cpu_cores"] for rs in per_repeat],
        "strategy": ranks[0]["strategy"],
        "launcher": ranks[0]["launcher"],
        "built_on_meta": ranks[0]["built_on_meta"],
        "raw": per_repeat,
    }


BASELINES = {"ddp": "×DDP", "fsdp2": "×FSDP2"}
# (header, value of a variant's summary, format, add a ratio column per baseline)
TIME_COLUMNS: list[bench.Column] = [
    ("step ms, median of repeats", lambda s: s["step_time_s"]["median"] * 1e3, "{:.0f}", True),
    ("step ms per repeat", lambda s: bench.joined(s["step_time_s"]["per_repeat"], "{:.0f}", 1e3), "{}", False),
    ("others' CPU use per repeat, cores", lambda s: bench.joined(s["other_cpu_cores"], "{:.2f}"), "{}", False),
    ("CPU ms/step/rank", lambda s: s["cpu_time_s"] * 1e3, "{:.0f}", True),
    ("last-step loss", lambda s: s["last_loss"], "{:.6f}", False),
]
SIZE_COLUMNS: list[bench.Column] = [
    ("peak RSS/rank MiB (max)", lambda s: s["peak_rss_bytes"] / MiB, "{:.0f}", True),
    ("per rank", lambda s: bench.joined(s["peak_rss_per_rank_bytes"], "{:.0f}", 1 / MiB), "{}", False),
    ("peak − RSS before build MiB", lambda s: (s["peak_rss_bytes"] - s["baseline_rss_bytes"]) / MiB, "{:.0f}", False),
]


def ratios_table(summary: dict[str, dict[str, Any]], columns: list[bench.Column]) -> str:
    """``_common.ratio_table`` with a ratio column to each of ``BASELINES`` (those that ran)."""
    bases = {name: title for name, title in BASELINES.items() if name in summary}
    header, rows = ["variant"], [[name] for name in summary]
    for title, value, fmt, ratio in columns:
        header += [title, *bases.values()] if ratio else [title]
        for row, record in zip(rows, summary.values(), strict=True):
            row.append(fmt.format(value(record)))
            if ratio:
                row += [f"{value(record) / value(summary[b]):.2f}×" if value(summary[b]) else "–" for b in bases]
    return bench.markdown_table(header, rows)


def report(summary: dict[str, dict[str, Any]]) -> str:
    lines = [ratios_table(summary, TIME_COLUMNS), "", ratios_table(summary, SIZE_COLUMNS), ""]
    ddp = summary.get("ddp")
    if ddp:
        worst = max(abs(s["last_loss"] - ddp["last_loss"]) for s in summary.values())
        lines.append(f"Loss sanity check: max |loss − DDP loss| at the last step = {worst:.2e}.")
    if not all(s["mmap_threshold_active"] for s in summary.values()):
        lines.append("NOTE: MALLOC_MMAP_THRESHOLD_ was not in effect in some rank: peak RSS includes freed heap.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in fields(BenchArgs):
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    parser.add_argument("--repeats", type=int, default=1, help="run all variants round-robin this many times")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {list(VARIANTS)}")
    bench.add_mmap_threshold_argument(parser)
    bench.add_contention_arguments(parser)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/lightning_step_time.json"))
    ns = parser.parse_args()
    variants = ns.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; known: {list(VARIANTS)}")
    args = BenchArgs(**{f.name: getattr(ns, f.name) for f in fields(BenchArgs)})
    with torch.device("meta"):
        psi = GPT(GPTConfig.bench25m()).num_parameters()
    env = {"MALLOC_MMAP_THRESHOLD_": str(ns.mmap_threshold) if ns.mmap_threshold else None}
    raw: dict[str, list[list[dict[str, Any]]]] = {v: [] for v in variants}
    for repeat in range(ns.repeats):
        for variant in variants:
            run = bench.run_ranks(
                bench_rank,
                args.world_size,
                (variant, args),
                env,
                ns.idle_wait,
                max_other_cores=ns.max_other_cores,
                attempts=ns.attempts,
            )
            ranks = run.results
            ranks[0]["other_cpu_cores"] = run.other_cpu_cores
            raw[variant].append(ranks)
            median = aggregate([ranks], args.warmup)["step_time_s"]["median"]
            print(
                f"[{repeat + 1}/{ns.repeats}] {variant}: {median * 1e3:.0f} ms/step, {run.wall_s:.0f} s, "
                f"other processes used {run.other_cpu_cores:.2f} cores meanwhile",
                flush=True,
            )
    summary = {v: aggregate(raw[v], args.warmup) for v in variants}
    text = report(summary) + f"\n(Ψ = {psi:,} parameters, N = {args.world_size}, batch {args.batch_size} per rank)"
    print(text)
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "machine": bench.machine_info() | {"lightning": importlib.metadata.version("lightning")},
        "args": asdict(args),
        "repeats": ns.repeats,
        "malloc_mmap_threshold": ns.mmap_threshold or "glibc default (dynamic)",
        "num_parameters": psi,
        "variants": summary,
        "report_markdown": text,
    }
    ns.out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
