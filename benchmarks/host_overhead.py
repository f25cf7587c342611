"""Stage 3's host time per unit per step against FSDP2's, at simulated world sizes and on gloo.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/host_overhead.py --rounds 7 --out benchmarks/results/host_overhead.json
    PYTHONPATH=$PWD .venv/bin/python benchmarks/host_overhead.py --gloo-ranks 2 --rounds 7 \\
        --out benchmarks/results/host_overhead_gloo.json

The real step (forward, backward, optimizer step) of a GPT of many small blocks (``--layers``, width ``--width``,
batch 2 x 32 tokens: the matmuls take microseconds, so a step is mostly the framework's own Python), timed per phase
and divided by the number of units (the blocks and the root), in three variants built on the same group. The clock
is the stepping thread's CPU time (``--clock cpu``, the default): on a machine shared with other jobs the wall time
of a step swings by 2-3x from one round to the next, its CPU time much less, and under the fake group all of a step
is this thread's CPU work (``--clock wall`` for wall time, which on gloo includes waiting for the peer).

- ``zero3``: ours, ``shard_module`` + ``ZeroOptimizer(AdamW)`` with the GPU's defaults (no divergence check);
- ``fsdp2``: torch's ``fully_shard`` on every block and on the root, ``AdamW`` over its DTensor parameters;
- ``plain``: the unsharded model and ``AdamW``: the model's own compute, which the two others pay too. The tables
  also give each variant's cost over it ("overhead"), the framework's own work per unit.

World sizes (``--sizes``, default 1, 8, 64, 1024) are simulated in one process with torch's fake process group
(``torch.testing._internal.distributed.fake_pg``): a world of the largest size, and a group of the first N ranks for
each smaller one. Every ``torch.distributed`` call goes through ``CollectiveClock``, which times it (those seconds
are reported apart, "in collective calls", and left out of the host figures), writes the same weights into every
all-gather at every size and zeros into every reduce-scatter (the numbers computed are meaningless, the figures are
times), and by default does not hand floating-point gathers and reduce-scatters to the fake group at all (see its
docstring), so what remains is each framework's own host work, including whatever of it grows with the world size.
With ``--gloo-ranks N`` the same variants run on N real gloo processes instead, where FSDP2's CPU collectives (plain
all-gathers with copies, no pairwise forms) weigh on its side: the comparison that counts is the fake group's.

Rounds are interleaved: each round runs ``--steps`` steps of every (size, variant), in an order rotated every round,
and keeps each one's fastest step (the least disturbed by other processes) with its split into phases. The tables
give the median over rounds, and the ratios (ours to FSDP2 at each size, ours at the largest size to ours at 8) are
taken within each round first, so the drift of a shared machine cancels out; their spread is the min and max over
rounds. ``--profile PATH`` instead runs ``--steps`` steps of ours at the largest size under cProfile and writes the
stats to PATH (``python -m pstats PATH``).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import cProfile
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, run_ranks

from lightning_zero import ZeroConfig, ZeroOptimizer, shard_module
from lightning_zero.models.gpt import GPT, Block, GPTConfig

PHASES = ("forward", "backward", "step")
COLUMNS = (*PHASES, "collectives")
VARIANTS = ("plain", "zero3", "fsdp2")


_COLLECTIVES = (
    "all_gather_single",
    "all_gather_into_tensor",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_reduce",
    "broadcast",
    "all_to_all_single",
    "isend",
    "irecv",
    "barrier",
)
"""The ``torch.distributed`` calls both frameworks make (FSDP2 and ours look them up on ``torch.distributed`` at each
call), timed by ``CollectiveClock``."""


class CollectiveClock:
    """Seconds spent inside ``torch.distributed``'s collective calls while installed. The fake process group's own
    work there grows with the world size (its all-gather copies the input into each of the N chunks of the output;
    its reduce-scatter costs ~1 ms per call at 1024 ranks whatever the size): the simulation's cost, which NCCL's
    launches do not have and both frameworks pay alike, so it is reported apart and left out of the host figures.

    ``fill_outputs``: what the fake collectives write depends on the world size (its all-gather tiles this rank's
    shard N times: at 1024 ranks every weight of a unit repeats its first few dozen values), and its reduce-scatter
    writes nothing. So every all-gather output is overwritten with the same values at every size (N(0, 0.02)
    draws, taken from one pool; integer outputs, stage 3's first-step index exchanges, stay tiled: every rank asked
    for the same unit) and every reduce-scatter output with zeros, on this clock: both frameworks compute on the
    same kind of weights at every size, and on finite ones.

    ``skip_fake`` (the default; ``--run-fake-collectives`` turns it off): those floating-point gathers and
    reduce-scatters are not handed to the fake group at all, only filled as above, and return a completed work.
    Its O(N) work per call is left out of the figures either way, but it still slows what runs after it (a step's
    layer norms took 2.3x their time at 1024 ranks, the same code on the same values: caches and allocator state
    disturbed by 1024 small copies per call), which the figures would wrongly charge to the framework."""

    def __init__(self) -> None:
        self.skip_fake = False
        self.seconds = 0.0
        self._originals: dict[str, Callable[..., Any]] = {}
        self._pool = torch.empty(0)

    def install(self, fill_outputs: bool = False) -> None:
        for name in _COLLECTIVES:
            original = getattr(dist, name)
            self._originals[name] = original
            fill = None
            if fill_outputs and name.startswith("reduce_scatter"):
                fill = torch.Tensor.zero_
            elif fill_outputs and name.startswith("all_gather"):
                fill = self._weights
            setattr(dist, name, self._timed(original, fill))

    def _weights(self, output: torch.Tensor) -> None:
        if not output.is_floating_point():  # stage 3's first-step index exchanges: every rank the same, as tiled
            return
        if self._pool.numel() < output.numel():
            self._pool = torch.randn(output.numel(), generator=torch.Generator().manual_seed(0)) * 0.02
        output.view(-1).copy_(self._pool[: output.numel()])

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()

    def _timed(self, function: Callable[..., Any], fill: Callable[[torch.Tensor], Any] | None) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = now()
            try:
                output = (args[0] if args else kwargs["output"]) if fill is not None else None
                if output is not None and output.is_floating_point() and self.skip_fake:
                    fill(output)
                    return _done() if kwargs.get("async_op") else None
                work = function(*args, **kwargs)
                if fill is not None:
                    fill(output)
                return work
            finally:
                self.seconds += now() - start

        timed.__name__ = function.__name__  # the ledger names the op it was handed
        return timed


def _done() -> dist.Work:
    future: torch.futures.Future[None] = torch.futures.Future()
    future.set_result(None)
    return torch._C._distributed_c10d._create_work_from_future(future)


CLOCK = CollectiveClock()
CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.thread_time, "wall": time.perf_counter}
now = CLOCKS["cpu"]
"""The clock every figure is read from (``--clock``, ``use_clock``)."""


def use_clock(name: str) -> None:
    global now
    now = CLOCKS[name]


@dataclass
class Stepper:
    """One variant on one group: ``step()`` runs a training step and returns its phases' seconds."""

    name: str
    world: int
    units: int
    step: Callable[[], tuple[float, float, float, float]]
    """Seconds of forward, backward and step without the collective calls, and in the collective calls."""


def _model(layers: int, width: int) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=layers, n_head=2, n_embd=width))


def _timed(
    forward: Callable[[], torch.Tensor], step: Callable[[], None]
) -> Callable[[], tuple[float, float, float, float]]:
    def run() -> tuple[float, float, float, float]:
        marks = [(now(), CLOCK.seconds)]
        loss = forward()
        marks.append((now(), CLOCK.seconds))
        loss.backward()
        marks.append((now(), CLOCK.seconds))
        step()
        marks.append((now(), CLOCK.seconds))
        phases = [(t1 - t0) - (c1 - c0) for (t0, c0), (t1, c1) in itertools.pairwise(marks)]
        return phases[0], phases[1], phases[2], marks[-1][1] - marks[0][1]

    return run


def build(variant: str, group: dist.ProcessGroup, layers: int, width: int, stage: int = 3) -> Stepper:
    model = _model(layers, width)
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    units = layers + 1
    if variant == "plain":
        adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
        optimizer_step: Callable[[], None] = lambda: (adamw.step(), adamw.zero_grad())  # noqa: E731
    elif variant == "zero3":
        config = ZeroConfig(stage=3, check_rank_divergence=False)  # the GPU's default
        gatherer = shard_module(model, config, group, torch.device("cpu"))
        assert len(gatherer.units) == units, gatherer
        zero = ZeroOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), group, config, gatherer)
        optimizer_step = lambda: (zero.step(), zero.zero_grad())  # noqa: E731
    elif variant == "fsdp2":
        mesh = DeviceMesh.from_group(group, "cpu")
        for module in model.modules():
            if isinstance(module, Block):
                fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
        adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
        optimizer_step = lambda: (adamw.step(), adamw.zero_grad())  # noqa: E731
    else:
        raise ValueError(f"Invalid variant: {variant!r}. Expected one of {VARIANTS}.")
    stepper = Stepper(variant, group.size(), units, _timed(lambda: model.loss(idx, idx), optimizer_step))
    for _ in range(2):  # warm-up: the first step's rounds and lazily created optimizer state
        stepper.step()
    return stepper


def measure(steppers: list[Stepper], rounds: int, steps: int) -> list[dict[str, Any]]:
    """Per round, per stepper (in ``steppers``' order): the fastest of ``steps`` steps, its phases in seconds."""
    records: list[dict[str, Any]] = []
    for r in range(rounds):
        shift = r % len(steppers)
        order = steppers[shift:] + steppers[:shift]
        best: dict[int, tuple[float, float, float]] = {}
        for stepper in order:
            times = [stepper.step() for _ in range(steps)]
            best[id(stepper)] = min(times, key=lambda t: sum(t[: len(PHASES)]))
        records.append({f"{s.name}@{s.world}": dict(zip(COLUMNS, best[id(s)], strict=True)) for s in steppers})
        print(f"  round {r + 1}/{rounds}", flush=True)
    return records


def _per_unit_us(phases: dict[str, float], units: int) -> dict[str, float]:
    values = {p: phases[p] / units * 1e6 for p in COLUMNS}
    values["total"] = sum(values[p] for p in PHASES)  # the host's own work: the collective calls left out
    return values


def summarize(records: list[dict[str, Any]], steppers: list[Stepper]) -> dict[str, Any]:
    """Medians over rounds of per-unit µs per phase, the overhead over ``plain``, and within-round ratios."""
    units = {f"{s.name}@{s.world}": s.units for s in steppers}
    per_round = [{key: _per_unit_us(phases, units[key]) for key, phases in rec.items()} for rec in records]
    table: dict[str, Any] = {}
    for key in units:
        table[key] = {p: statistics.median(r[key][p] for r in per_round) for p in (*COLUMNS, "total")}
        plain = f"plain@{key.split('@')[1]}"
        if plain in units and not key.startswith("plain"):
            table[key]["overhead"] = statistics.median(r[key]["total"] - r[plain]["total"] for r in per_round)
    ratios: dict[str, dict[str, float]] = {}

    def ratio(name: str, values: list[float]) -> None:
        ratios[name] = {"median": statistics.median(values), "min": min(values), "max": max(values)}

    worlds = sorted({s.world for s in steppers})
    for world in worlds:
        ours, peer, plain = f"zero3@{world}", f"fsdp2@{world}", f"plain@{world}"
        if ours in units and peer in units:
            ratio(f"zero3/fsdp2@{world}", [r[ours]["total"] / r[peer]["total"] for r in per_round])
            if plain in units:
                overheads = [
                    (r[ours]["total"] - r[plain]["total"]) / (r[peer]["total"] - r[plain]["total"]) for r in per_round
                ]
                ratio(f"zero3/fsdp2 overhead@{world}", overheads)
    if 8 in worlds and len(worlds) > 1 and worlds[-1] > 8:
        for name in ("zero3", "fsdp2"):
            big, small = f"{name}@{worlds[-1]}", f"{name}@8"
            if big in units and small in units:
                ratio(f"{big}/{small}", [r[big]["total"] / r[small]["total"] for r in per_round])
    return {"per_unit_us": table, "ratios": ratios}


def print_tables(summary: dict[str, Any], title: str) -> None:
    print(f"\n{title}: host µs per unit per step (median over rounds)\n")
    print("| variant @ world | forward | backward | step | total | over plain | in collective calls |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for key, row in summary["per_unit_us"].items():
        over = f"{row['overhead']:.0f}" if "overhead" in row else ""
        cells = " | ".join(f"{row[p]:.0f}" for p in (*PHASES, "total"))
        print(f"| {key} | {cells} | {over} | {row['collectives']:.0f} |")
    print("\n| ratio (within rounds) | median | min | max |")
    print("|---|---:|---:|---:|")
    for name, r in summary["ratios"].items():
        print(f"| {name} | {r['median']:.3f} | {r['min']:.3f} | {r['max']:.3f} |")


def simulated(sizes: list[int], variants: list[str], layers: int, width: int, rounds: int, steps: int) -> Any:
    """Every (size, variant) in this process under the fake process group."""
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    world = max(sizes)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    CLOCK.install(fill_outputs=True)
    try:
        steppers = []
        for size in sizes:
            group = dist.group.WORLD if size == world else dist.new_group(list(range(size)))
            assert group is not None
            steppers += [build(v, group, layers, width) for v in variants]
        records = measure(steppers, rounds, steps)
        return records, steppers
    finally:
        CLOCK.uninstall()
        dist.destroy_process_group()


def _gloo_rank(
    rank: int, world_size: int, variants: list[str], layers: int, width: int, rounds: int, steps: int, clock: str
) -> Any:
    use_clock(clock)  # a fresh process
    group = dist.group.WORLD
    assert group is not None
    CLOCK.install()  # on gloo the calls only post the work: waiting for peers is in the phases
    steppers = [build(v, group, layers, width) for v in variants]
    records = measure(steppers, rounds, steps) if rank == 0 else _follow(steppers, rounds, steps)
    return records, [(s.name, s.world, s.units) for s in steppers]


def _follow(steppers: list[Stepper], rounds: int, steps: int) -> list[dict[str, Any]]:
    """The other ranks run the same steps in the same order (their collectives pair with rank 0's)."""
    for r in range(rounds):
        shift = r % len(steppers)
        for stepper in steppers[shift:] + steppers[:shift]:
            for _ in range(steps):
                stepper.step()
    return []


def profile(path: str, size: int, layers: int, width: int, steps: int) -> None:
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    CLOCK.install(fill_outputs=True)
    try:
        group = dist.group.WORLD
        assert group is not None
        stepper = build("zero3", group, layers, width)
        profiler = cProfile.Profile(now)  # the chosen clock (--clock)
        profiler.enable()
        for _ in range(steps):
            stepper.step()
        profiler.disable()
        profiler.dump_stats(path)
        print(f"wrote {path}: `python -m pstats {path}`, then `sort tottime`, `stats 30`")
    finally:
        CLOCK.uninstall()
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 64, 1024], help="simulated world sizes")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--layers", type=int, default=32, help="GPT blocks (units: blocks + the root)")
    parser.add_argument("--width", type=int, default=64, help="n_embd")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3, help="steps per (size, variant) per round; the fastest counts")
    parser.add_argument("--gloo-ranks", type=int, default=0, help="run on this many gloo processes instead")
    parser.add_argument(
        "--run-fake-collectives", action="store_true", help="hand gathers and reduce-scatters to the fake group too"
    )
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="cpu", help="the thread's CPU time, or wall time")
    parser.add_argument("--profile", default=None, help="cProfile ours at the largest size into this file")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    use_clock(args.clock)
    CLOCK.skip_fake = not args.run_fake_collectives
    if args.profile:
        profile(args.profile, max(args.sizes), args.layers, args.width, args.steps)
        return
    load_before = os.getloadavg()
    if args.gloo_ranks:
        shape = (args.variants, args.layers, args.width, args.rounds, args.steps, args.clock)
        run = run_ranks(_gloo_rank, args.gloo_ranks, shape)
        records, shapes = run.results[0]
        steppers = [Stepper(name, world, units, lambda: (0.0, 0.0, 0.0, 0.0)) for name, world, units in shapes]
        title = f"{args.gloo_ranks} gloo processes, {args.clock} time"
    else:
        records, steppers = simulated(args.sizes, args.variants, args.layers, args.width, args.rounds, args.steps)
        title = f"fake process group, worlds {args.sizes}, {args.clock} time"
    summary = summarize(records, steppers)
    print_tables(summary, f"{title}, GPT of {args.layers} blocks (width {args.width}), {args.layers + 1} units")
    load_after = os.getloadavg()
    print(f"\nload average before / after: {load_before[0]:.2f} / {load_after[0]:.2f}")
    if args.out:
        result = {
            "machine": machine_info(),
            "args": vars(args),
            "load_average": {"before": load_before, "after": load_after},
            "summary": summary,
            "rounds": records,
        }
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
