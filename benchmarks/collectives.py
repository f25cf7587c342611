"""Microbenchmark of the gloo collectives ZeRO is built from, on fp32 buckets of several sizes.

    .venv/bin/python benchmarks/collectives.py --world-size 2 --sizes 500000,4000000,25000000 --repeats 5 \\
        --out benchmarks/results/collectives.json

For a bucket of ``size`` fp32 elements (the full, unsharded bucket) each rank times:

* ``all_reduce``: in place over the bucket (what DDP does);
* ``reduce_scatter_single``: the bucket in, this rank's 1/N shard out (torch's native gloo reduce-scatter);
* ``all_to_all_single+sum``: every rank sends chunk r to rank r, then sums the N received chunks into its shard;
* ``lightning_zero reduce_scatter``: ``lightning_zero.comm.collectives.reduce_scatter`` end to end, with a reused
  receive buffer as the gradient reducer's pool lends it (on gloo: the all-to-all form above plus the average of the
  shard);
* ``all_gather_single``: a 1/N shard in, the whole bucket out (torch's native gloo all-gather);
* ``lightning_zero all_gather``: ``lightning_zero.comm.collectives.all_gather`` in place (on gloo: N broadcasts);
* two alternatives built from N in-place rooted collectives on the bucket's shard views, one per rank: ``reduce``
  (chunk r summed into rank r: a reduce-scatter) and ``broadcast`` (rank r's shard sent to all: an all-gather). For
  N = 2 they put the same bytes on the wire as the bandwidth-optimal reduce-scatter and all-gather.

Ranks are fresh spawned processes with one compute thread each and the same environment as ``step_time.py``
(``MALLOC_MMAP_THRESHOLD_=65536``). Each timing starts after a barrier and ends when the collective (and its local
post-processing) has completed on that rank; an op's time is the slowest rank's. The reported figure is the median of
``--repeats`` timings after ``--warmup`` untimed ones. "Sent" is what one rank puts on the wire with a
bandwidth-optimal algorithm, and GB/s is sent bytes / time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _common as bench
import torch
import torch.distributed as dist

from lightning_zero.comm.collectives import all_gather, reduce_scatter

Op = Callable[[int, int], Callable[[], None]]
"""(bucket numel, world size) -> a closure running the collective once on preallocated buffers."""


def _all_reduce(numel: int, world: int) -> Callable[[], None]:
    buf = torch.ones(numel)
    return lambda: dist.all_reduce(buf)


def _reduce_scatter_single(numel: int, world: int) -> Callable[[], None]:
    inp, out = torch.ones(numel), torch.empty(numel // world)
    return lambda: dist.reduce_scatter_single(out, inp)


def _all_to_all_sum(numel: int, world: int) -> Callable[[], None]:
    inp, received, out = torch.ones(numel), torch.empty(numel), torch.empty(numel // world)

    def run() -> None:
        dist.all_to_all_single(received, inp)
        torch.sum(received.view(world, -1), dim=0, out=out)

    return run


def _lightning_zero_reduce_scatter(numel: int, world: int) -> Callable[[], None]:
    inp, out, scratch = torch.ones(numel), torch.empty(numel // world), torch.empty(numel)
    return lambda: reduce_scatter(out, inp, dist.group.WORLD, scratch=scratch).wait()


def _lightning_zero_all_gather(numel: int, world: int) -> Callable[[], None]:
    full = torch.ones(numel)
    shard = full.view(world, -1)[dist.get_rank()]
    return lambda: all_gather(full, shard, dist.group.WORLD).wait()


def _all_gather_single(numel: int, world: int) -> Callable[[], None]:
    out = torch.empty(numel)
    shard = torch.ones(numel // world)
    return lambda: dist.all_gather_single(out, shard)


def _broadcast_per_rank(numel: int, world: int) -> Callable[[], None]:
    out = torch.ones(numel)
    shards = out.chunk(world)  # in-place views: rank r broadcasts its own shard, the others receive into theirs

    def run() -> None:
        for work in [dist.broadcast(shard, src=r, async_op=True) for r, shard in enumerate(shards)]:
            work.wait()

    return run


def _reduce_per_rank(numel: int, world: int) -> Callable[[], None]:
    inp = torch.ones(numel)
    chunks = inp.chunk(world)  # chunk r is summed into rank r's copy of it, in place

    def run() -> None:
        for work in [dist.reduce(chunk, dst=r, async_op=True) for r, chunk in enumerate(chunks)]:
            work.wait()

    return run


# name -> (op, bytes one rank sends for a bucket of ``n`` bytes on ``N`` ranks)
OPS: dict[str, tuple[Op, Callable[[int, int], int]]] = {
    "all_reduce": (_all_reduce, lambda n, w: 2 * n * (w - 1) // w),
    "reduce_scatter_single": (_reduce_scatter_single, lambda n, w: n * (w - 1) // w),
    "all_to_all_single+sum": (_all_to_all_sum, lambda n, w: n * (w - 1) // w),
    "lightning_zero reduce_scatter": (_lightning_zero_reduce_scatter, lambda n, w: n * (w - 1) // w),
    "all_gather_single": (_all_gather_single, lambda n, w: n * (w - 1) // w),
    "lightning_zero all_gather": (_lightning_zero_all_gather, lambda n, w: n * (w - 1) // w),
    # N in-place collectives, one rooted at each rank (lightning_zero's all-gather is the broadcast form).
    "alt: reduce × N (a reduce-scatter)": (_reduce_per_rank, lambda n, w: n * (w - 1) // w),
    "alt: broadcast × N (an all-gather)": (_broadcast_per_rank, lambda n, w: n * (w - 1) // w),
}


def bench_rank(
    rank: int, world: int, sizes: list[int], warmup: int, repeats: int, device_type: str = "cpu"
) -> dict[str, dict[int, list[float]]]:
    """Runs on every rank: ``{op: {size: [seconds, ...]}}`` for this rank."""
    times: dict[str, dict[int, list[float]]] = {name: {} for name in OPS}
    device = bench.rank_device(device_type)
    for size in sizes:
        numel = size - size % world  # the bucket splits into equal shards
        for name, (make, _) in OPS.items():
            with device:  # the buffers live on this rank's device
                run = make(numel, world)
            samples = []
            for i in range(warmup + repeats):
                dist.barrier()
                bench.synchronize(device)
                start = time.perf_counter()
                run()
                bench.synchronize(device)  # a GPU collective ends when its kernel does
                if i >= warmup:
                    samples.append(time.perf_counter() - start)
            times[name][size] = samples
            del run
    return times


def _size_label(size: int) -> str:
    return f"{size / 1e6:g}M"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    bench.add_device_arguments(parser)
    parser.add_argument("--sizes", default="500000,4000000,25000000", help="comma-separated fp32 element counts")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    bench.add_contention_arguments(parser)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/collectives.json"))
    ns = parser.parse_args()
    bench.check_device_arguments(parser, ns)
    sizes = [int(s) for s in ns.sizes.split(",")]
    run = bench.run_ranks(
        bench_rank,
        ns.world_size,
        (sizes, ns.warmup, ns.repeats, ns.device),
        idle_wait=ns.idle_wait,
        max_other_cores=ns.max_other_cores,
        attempts=ns.attempts,
        backend=ns.backend,
    )
    per_rank = run.results

    results: dict[str, dict[str, Any]] = {}
    rows = []
    for name, (_, sent_bytes) in OPS.items():
        results[name] = {}
        for size in sizes:
            slowest = [max(ts) for ts in zip(*(r[name][size] for r in per_rank), strict=True)]
            median = statistics.median(slowest)
            sent = sent_bytes(size * 4, ns.world_size)
            results[name][str(size)] = {**bench.summarize(slowest), "sent_bytes": sent, "samples_s": slowest}
            rate = sent / median / 1e9
            rows.append([name, _size_label(size), f"{median * 1e3:.1f}", f"{sent / 2**20:.1f}", f"{rate:.2f}"])

    # One compact view: ms per op (rows) and size (columns).
    compact = [[name] + [f"{results[name][str(size)]['median'] * 1e3:.1f}" for size in sizes] for name in OPS]
    text = "\n".join(
        [
            bench.markdown_table(["op", "bucket (fp32 elements)", "median ms", "sent MiB/rank", "GB/s"], rows),
            "",
            bench.markdown_table(["median ms"] + [_size_label(s) for s in sizes], compact),
        ]
    )
    text += f"\n\nOther processes used {run.other_cpu_cores:.2f} CPU cores on average during the run."
    print(text)
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "machine": bench.machine_info(),
        "world_size": ns.world_size,
        "warmup": ns.warmup,
        "repeats": ns.repeats,
        "other_cpu_cores": run.other_cpu_cores,
        "results": results,
        "report_markdown": text,
    }
    ns.out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
