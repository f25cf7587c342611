"""Step time, peak memory, model-state bytes and communication per step of a ~25M GPT under data-parallel variants.

    .venv/bin/python benchmarks/step_time.py --world-size 2 --steps 20 --warmup 5 --batch-size 8 \\
        --out benchmarks/results/step_time.json

Every variant trains the same model (``GPTConfig.bench25m()``, seq 128, fp32, AdamW) from the same seed on the same
per-rank batches, on ``--world-size`` gloo ranks that are fresh spawned processes (one compute thread each, glibc
``MALLOC_MMAP_THRESHOLD_=65536`` so that peak RSS tracks live tensors). A step is timed from a barrier to the end of
the optimizer step; the step time of a step is the slowest rank's, and the reported figure is the median over the
steps after ``--warmup``. ``--repeats R`` runs the variants round-robin R times and reports every repeat. Each run
first waits (up to ``--idle-wait`` s) for an idle machine and is re-run (up to ``--attempts``) if other processes used
more than ``--max-other-cores`` CPUs meanwhile; what they used is reported. ``--mmap-threshold 0`` leaves glibc's
default (dynamic) malloc threshold: step times then include no page faults of recycled buffers, but freed memory stays
in the heap, so peak RSS is no longer meaningful.

Adding a variant (stage 3, FSDP2, DeepSpeed, ...) is one function decorated with ``@runner("name")``: it receives a
seeded model factory and the arguments, and returns a ``Prepared`` (a step function plus memory and byte counters).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import _common as bench
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from lightning_zero import ZeroConfig, ZeroOptimizer, expected_model_state_bytes, model_state_bytes, shard_module
from lightning_zero.models import GPT, GPTConfig

MiB = 2**20
METER = bench.TrafficMeter()
"""This rank's traffic through torch.distributed's Python collectives: the measured bytes of FSDP2 and DeepSpeed,
and a cross-check of our ledger."""


@dataclass(frozen=True)
class BenchArgs:
    """Command-line arguments shared by every rank (each field is a ``--flag``)."""

    world_size: int = 2
    steps: int = 20
    """Timed steps per variant."""
    warmup: int = 5
    """Untimed steps before them."""
    batch_size: int = 8
    """Sequences of ``block_size`` (128) tokens per rank and step."""
    lr: float = 3e-4
    seed: int = 1234
    keep_reduce_buffers: str = "default"
    """Our stages' ``ZeroConfig.keep_reduce_buffers``: default (None), true or false."""
    device: str = "cpu"
    """cpu, or cuda (one GPU per rank); set by ``--device``."""
    backend: str = "gloo"
    """gloo or nccl; set by ``--backend`` (default: nccl on cuda)."""

    def rank_device(self) -> torch.device:
        return bench.rank_device(self.device)

    def zero_config(self, stage: int) -> ZeroConfig:
        keep = {"default": None, "true": True, "false": False}[self.keep_reduce_buffers]
        return ZeroConfig(stage=stage, keep_reduce_buffers=keep)  # type: ignore[arg-type]  # stage: 1 | 2 | 3


@dataclass
class Prepared:
    """What a runner hands back: how to take one optimizer step, and how to account for it."""

    step: Callable[[Tensor, Tensor], Tensor]
    """One full training step on a (B, T) batch of inputs and targets; returns the detached loss."""
    state_bytes: Callable[[], int]
    """Model-state bytes (parameters, gradients, master weights, optimizer state) this rank holds after a step."""
    comm_bytes: Callable[[], dict[str, int]]
    """Bytes this rank sent in the last step, per collective."""
    comm_source: str
    """Where ``comm_bytes`` comes from: a measurement, or which theoretical formula."""
    expected_state_bytes: int
    """The ZeRO paper's model-state formula for this variant (fp32: 4 B params + 4 B grads + 8 B Adam moments)."""


Runner = Callable[[Callable[[], GPT], BenchArgs], Prepared]
RUNNERS: dict[str, Runner] = {}


def runner(name: str) -> Callable[[Runner], Runner]:
    def register(fn: Runner) -> Runner:
        RUNNERS[name] = fn
        return fn

    return register


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """``GPT.loss`` on logits computed through whatever wrapper the variant uses (DDP must see the forward)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def fp32_expected(psi: int, world: int, stage: int) -> int:
    return expected_model_state_bytes(psi, world, stage, param_bytes=4, master_bytes=0, optimizer_state_bytes=8).total


def make_step(forward: Callable[[Tensor], Tensor], opt: torch.optim.Optimizer) -> Callable[[Tensor, Tensor], Tensor]:
    def step(x: Tensor, y: Tensor) -> Tensor:
        opt.zero_grad()
        loss = lm_loss(forward(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def replicated_state_bytes(model: GPT, opt: torch.optim.Optimizer) -> int:
    """Parameters + ``.grad`` + optimizer state by counting tensors. DDP's flat gradient buckets (another 4 B/param
    with the default ``gradient_as_bucket_view=False``) are internal to its C++ reducer and not counted."""
    params = list(model.parameters())
    return bench.tensor_bytes(params + [p.grad for p in params if p.grad is not None] + bench.adam_state(opt))


def metered_ddp(model: GPT) -> DistributedDataParallel:
    """DDP whose bucket all-reduce is issued from Python (``allreduce_hook``: the same average, divided by N, as its
    C++ default), so that ``METER`` sees what DDP hands ``torch.distributed`` instead of a formula."""
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    return ddp


@runner("ddp")
def run_ddp(build: Callable[[], GPT], args: BenchArgs) -> Prepared:
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    psi, world = model.num_parameters(), dist.get_world_size()
    return Prepared(
        make_step(metered_ddp(model), opt),
        lambda: replicated_state_bytes(model, opt),
        lambda: dict(METER.last_step),
        "measured: torch.distributed calls of DDP's all-reduce hook (benchmarks/_common.py TrafficMeter)",
        fp32_expected(psi, world, 0),
    )


@runner("ddp+torch_zero")
def run_ddp_torch_zero(build: Callable[[], GPT], args: BenchArgs) -> Prepared:
    model = build()
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=args.lr)
    psi, world = model.num_parameters(), dist.get_world_size()
    return Prepared(
        make_step(metered_ddp(model), opt),
        lambda: replicated_state_bytes(model, opt.optim),
        lambda: dict(METER.last_step),
        "measured: torch.distributed calls (DDP's all-reduce hook, ZeroRedundancyOptimizer's broadcasts)",
        fp32_expected(psi, world, 1),
    )


def _run_ours(stage: int, build: Callable[[], GPT], args: BenchArgs) -> Prepared:
    model = build()
    zopt = ZeroOptimizer(
        model, torch.optim.AdamW(model.parameters(), lr=args.lr), dist.group.WORLD, args.zero_config(stage)
    )
    return Prepared(
        make_step(model, zopt),
        lambda: model_state_bytes(model, [zopt]).total,
        zopt.ledger.last_step_bytes,
        "measured: ZeroOptimizer.ledger",
        fp32_expected(model.num_parameters(), dist.get_world_size(), stage),
    )


@runner("zero1")
def run_zero1(build: Callable[[], GPT], args: BenchArgs) -> Prepared:
    return _run_ours(1, build, args)


@runner("zero2")
def run_zero2(build: Callable[[], GPT], args: BenchArgs) -> Prepared:
    return _run_ours(2, build, args)


# -- stage 3 and its peers ----------------------------------------------------------------------------------------
@runner("zero3")
def run_zero3(build: Callable[[], GPT], args: BenchArgs) -> Prepared:
    return _run_zero3(args.zero_config(3), build, args)


@runner("zero3_root_kept")
def run_zero3_root_kept(build: Callable[[], GPT], args: BenchArgs) -> Prepared:
    """Stage 3 with ``reshard_root_after_forward=False`` (FSDP2's treatment of its root)."""
    return _run_zero3(dataclasses.replace(args.zero_config(3), reshard_root_after_forward=False), build, args)


def _run_zero3(config: ZeroConfig, build: Callable[[], GPT], args: BenchArgs) -> Prepared:
    with torch.device("meta"):  # sharded init: the model is never materialized whole
        model = build()
    gatherer = shard_module(model, config, dist.group.WORLD, args.rank_device())
    zopt = ZeroOptimizer(model, torch.optim.AdamW(model.parameters(), lr=args.lr), dist.group.WORLD, config, gatherer)
    return Prepared(
        make_step(model, zopt),
        lambda: model_state_bytes(model, [zopt], gatherer).total,
        zopt.ledger.last_step_bytes,
        "measured: ZeroOptimizer.ledger (both all-gathers and the reduce-scatter)",
        fp32_expected(model.num_parameters(), dist.get_world_size(), 3),
    )


@runner("fsdp2")
def run_fsdp2(build: Callable[[], GPT], args: BenchArgs) -> Prepared:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build()
    psi, world = model.num_parameters(), dist.get_world_size()
    mesh = init_device_mesh(args.device, (world,))
    for block in model.blocks:  # one unit per block, as our stage 3's default policy, plus the root
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    def local(tensors: list[Tensor]) -> list[Tensor]:
        return [t.to_local() if hasattr(t, "to_local") else t for t in tensors]

    def state_bytes() -> int:
        params = list(model.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        return bench.tensor_bytes(local(params) + local(grads) + local(bench.adam_state(opt)))

    return Prepared(
        make_step(model, opt),
        state_bytes,
        lambda: dict(METER.last_step),
        "measured: torch.distributed calls (benchmarks/_common.py TrafficMeter)",
        fp32_expected(psi, world, 3),
    )


if importlib.util.find_spec("deepspeed") is not None:  # a benchmark peer only, never a dependency

    @runner("deepspeed3")
    def run_deepspeed3(build: Callable[[], GPT], args: BenchArgs) -> Prepared:
        os.environ.setdefault("DS_ACCELERATOR", args.device)
        os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))  # DeepSpeed asks its launcher's variable (one node)
        import deepspeed

        model = build()
        psi, world = model.num_parameters(), dist.get_world_size()
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        config = {
            "train_micro_batch_size_per_gpu": args.batch_size,
            "zero_optimization": {"stage": 3},
            "zero_allow_untested_optimizer": True,  # torch's AdamW: DeepSpeed's CPU Adam needs a compiled extension
        }
        engine, ds_opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)

        def step(x: Tensor, y: Tensor) -> Tensor:
            loss = lm_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            return loss.detach()

        def state_bytes() -> int:
            partitions = [p.ds_tensor for p in model.parameters() if hasattr(p, "ds_tensor")]
            masters = list(getattr(ds_opt, "fp32_partitioned_groups_flat", []))
            grads = [m.grad for m in masters if m.grad is not None]
            return bench.tensor_bytes(partitions + masters + grads + bench.adam_state(ds_opt.optimizer))

        return Prepared(
            step,
            state_bytes,
            lambda: dict(METER.last_step),
            "measured: torch.distributed calls (benchmarks/_common.py TrafficMeter)",
            fp32_expected(psi, world, 3),
        )


def bench_rank(rank: int, world: int, variant: str, args: BenchArgs) -> dict[str, Any]:
    """Runs on every rank: build, train ``warmup + steps`` steps, report timings, memory and bytes."""
    baseline = bench.memory_status()
    config = GPTConfig.bench25m()

    def build() -> GPT:
        torch.manual_seed(args.seed)  # the same initial weights on every rank and in every variant
        return GPT(config)

    METER.install()  # before the variant is built: DeepSpeed captures the collectives it will call
    device = args.rank_device()
    with device:  # models are built on this rank's device (stage 3 overrides it with meta inside)
        prepared = RUNNERS[variant](build, args)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)  # different data per rank, same across variants
    tokens = [
        torch.randint(config.vocab_size, (args.batch_size, config.block_size + 1), generator=gen).to(device)
        for _ in range(args.warmup + args.steps)
    ]
    times, cpu_times, losses = [], [], []
    for batch in tokens:
        x, y = batch[:, :-1], batch[:, 1:]
        dist.barrier()
        METER.start_step()
        start, cpu_start = time.perf_counter(), time.process_time()
        loss = prepared.step(x, y)
        bench.synchronize(device)  # a GPU step ends when its kernels do, not when they are queued
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)  # all threads of this rank, gloo's included
        losses.append(loss.item())
    METER.start_step()  # the last step's traffic moves to METER.last_step
    return {
        "times": times,
        "cpu_times": cpu_times,
        "losses": losses,
        "state_bytes": prepared.state_bytes(),
        "expected_state_bytes": prepared.expected_state_bytes,
        "comm_bytes": prepared.comm_bytes(),
        "comm_source": prepared.comm_source,
        "torch_distributed_bytes": dict(METER.last_step),
        "memory": bench.memory_status(),
        "baseline_memory": baseline,
        "mmap_threshold_active": bench.mmap_threshold_active(),
    }


def aggregate(per_repeat: list[list[dict[str, Any]]], warmup: int, zero_theory_bytes: int) -> dict[str, Any]:
    """Per-repeat results (each a list over ranks) -> one variant's summary."""
    medians = []
    for ranks in per_repeat:
        slowest = [max(r["times"][i] for r in ranks) for i in range(warmup, len(ranks[0]["times"]))]
        medians.append(statistics.median(slowest))
    ranks = per_repeat[-1]
    comm = ranks[0]["comm_bytes"]
    return {
        "step_time_s": bench.summarize(medians) | {"per_repeat": medians},
        "cpu_time_s": statistics.median(t for rs in per_repeat for r in rs for t in r["cpu_times"][warmup:]),
        "peak_rss_bytes": max(r["memory"]["VmHWM"] for rs in per_repeat for r in rs),
        "peak_ru_maxrss_bytes": max(r["memory"]["ru_maxrss"] for rs in per_repeat for r in rs),
        "baseline_rss_bytes": max(r["baseline_memory"]["VmRSS"] for rs in per_repeat for r in rs),
        "state_bytes": max(r["state_bytes"] for r in ranks),
        "expected_state_bytes": ranks[0]["expected_state_bytes"],
        "comm_bytes": comm,
        "comm_bytes_total": sum(comm.values()),
        "zero_theory_bytes": zero_theory_bytes,
        "comm_source": ranks[0]["comm_source"],
        "last_loss": statistics.fmean(r["losses"][-1] for r in ranks),
        "mmap_threshold_active": all(r["mmap_threshold_active"] for rs in per_repeat for r in rs),
        "other_cpu_cores": [rs[0]["other_cpu_cores"] for rs in per_repeat],
        "raw": per_repeat,
    }


# Two tables of (header, value of a variant's summary, format, add a "×DDP" column).
TIME_COLUMNS: list[bench.Column] = [
    ("step ms, median of repeats", lambda s: s["step_time_s"]["median"] * 1e3, "{:.0f}", True),
    ("step ms, best repeat", lambda s: s["step_time_s"]["min"] * 1e3, "{:.0f}", True),
    ("step ms per repeat", lambda s: bench.joined(s["step_time_s"]["per_repeat"], "{:.0f}", 1e3), "{}", False),
    ("others' CPU use per repeat, cores", lambda s: bench.joined(s["other_cpu_cores"], "{:.2f}"), "{}", False),
    ("CPU ms/step/rank", lambda s: s["cpu_time_s"] * 1e3, "{:.0f}", True),
    ("last-step loss", lambda s: s["last_loss"], "{:.6f}", False),
]
SIZE_COLUMNS: list[bench.Column] = [
    ("peak RSS/rank MiB", lambda s: s["peak_rss_bytes"] / MiB, "{:.0f}", True),
    ("peak − RSS before build MiB", lambda s: (s["peak_rss_bytes"] - s["baseline_rss_bytes"]) / MiB, "{:.0f}", False),
    ("model state MiB", lambda s: s["state_bytes"] / MiB, "{:.1f}", True),
    ("(theory)", lambda s: s["expected_state_bytes"] / MiB, "{:.1f}", False),
    ("sent B/step/rank", lambda s: s["comm_bytes_total"], "{:,}", True),
    ("sent ÷ 2Ψ·4·(N−1)/N", lambda s: s["comm_bytes_total"] / s["zero_theory_bytes"], "{:.6f}", False),
]


def report(summary: dict[str, dict[str, Any]]) -> str:
    ddp = summary.get("ddp")
    sources = [f"- sent bytes of {name}: {s['comm_source']} ({s['comm_bytes']})" for name, s in summary.items()]
    tables = [bench.ratio_table(summary, columns, "ddp", "×DDP") for columns in (TIME_COLUMNS, SIZE_COLUMNS)]
    lines = [tables[0], "", tables[1], "", *sources, ""]
    if ddp:
        worst = max(abs(s["last_loss"] - ddp["last_loss"]) for s in summary.values())
        lines.append(f"Loss sanity check: max |loss − DDP loss| at the last step = {worst:.2e}.")
    if not all(s["mmap_threshold_active"] for s in summary.values()):
        lines.append("NOTE: MALLOC_MMAP_THRESHOLD_ was not in effect in some rank: peak RSS includes freed heap.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_device_arguments(parser)
    for f in fields(BenchArgs):
        if f.name in ("device", "backend"):
            continue
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    parser.add_argument("--repeats", type=int, default=1, help="run all variants round-robin this many times")
    parser.add_argument("--variants", default=",".join(RUNNERS), help=f"comma-separated subset of {list(RUNNERS)}")
    bench.add_mmap_threshold_argument(parser)
    bench.add_contention_arguments(parser)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/step_time.json"))
    ns = parser.parse_args()
    bench.check_device_arguments(parser, ns)
    variants = ns.variants.split(",")
    unknown = sorted(set(variants) - set(RUNNERS))
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; known: {list(RUNNERS)}")
    args = BenchArgs(**{f.name: getattr(ns, f.name) for f in fields(BenchArgs)})
    if args.keep_reduce_buffers not in ("default", "true", "false"):
        parser.error(f"--keep-reduce-buffers must be default, true or false, got {args.keep_reduce_buffers!r}")
    with torch.device("meta"):
        psi = GPT(GPTConfig.bench25m()).num_parameters()
    theory = bench.ring_all_reduce_bytes(psi, args.world_size)
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
                backend=args.backend,
            )
            ranks = run.results
            ranks[0]["other_cpu_cores"] = run.other_cpu_cores
            raw[variant].append(ranks)
            median = aggregate([ranks], args.warmup, theory)["step_time_s"]["median"]
            print(
                f"[{repeat + 1}/{ns.repeats}] {variant}: {median * 1e3:.0f} ms/step, {run.wall_s:.0f} s, "
                f"other processes used {run.other_cpu_cores:.2f} cores meanwhile",
                flush=True,
            )
    summary = {v: aggregate(raw[v], args.warmup, theory) for v in variants}
    text = report(summary) + f"\n(Ψ = {psi:,} parameters, N = {args.world_size}: 2Ψ·4·(N−1)/N = {theory:,} B)"
    print(text)
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "machine": bench.machine_info(),
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
