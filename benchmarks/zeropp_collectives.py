"""Microbenchmark of ZeRO++'s quantized collectives on gloo, against the exact ones they replace.

    .venv/bin/python benchmarks/zeropp_collectives.py --world-size 4 --shard 1000000 --repeats 10 \\
        --out benchmarks/results/zeropp_collectives.json

For a shard of ``--shard`` bf16 elements per rank (a bucket of ``world * shard``), each rank times, after a barrier
and until the collective and its local post-processing are complete (an op's time is the slowest rank's, the figure
the median of ``--repeats``):

* ``all_gather bf16``: ``lightning_zero.comm.collectives.all_gather`` of the exact shards (N broadcasts on gloo);
* ``int8 packed``: ``quantized_all_gather``: the int8 codes and their scales packed into one byte row per rank, one
  gather, dequantized into bf16 (what qwZ does);
* ``int8 codes + scales``: the same bytes as two gathers, codes and scales separately, dequantized the same way;
* ``reduce_scatter bf16``: ``collectives.reduce_scatter`` of the bucket (the all-to-all form on gloo);
* ``hierarchical int4`` / ``int8``: ``HierarchicalReduceScatter`` over ``--ranks-per-node`` ranks per node (what
  qgZ does).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import _common as bench
import torch
import torch.distributed as dist

from lightning_zero.comm.collectives import all_gather, reduce_scatter
from lightning_zero.comm.hierarchical_reduce import HierarchicalReduceScatter
from lightning_zero.comm.quantization import PackedLayout, dequantize_rows, quantize_rows
from lightning_zero.comm.quantized_all_gather import quantized_all_gather
from lightning_zero.comm.topology import build_node_groups

BLOCK = 2048


def _ops(shard: int, world: int, ranks_per_node: int) -> dict[str, Callable[[], None]]:
    rank = dist.get_rank()
    group = dist.group.WORLD
    mine = torch.randn(shard).to(torch.bfloat16)
    full = torch.empty(world * shard, dtype=torch.bfloat16)
    layout = PackedLayout(shard, BLOCK, 8)
    codes = torch.empty(world, layout.code_bytes, dtype=torch.uint8)
    scales = torch.empty(world, layout.blocks, dtype=torch.float32)

    def two_gathers() -> None:
        packed = quantize_rows(mine.view(1, -1), BLOCK, 8)
        codes[rank].copy_(packed[0, layout.scale_bytes : layout.scale_bytes + layout.code_bytes])
        scales[rank].copy_(packed[0, : layout.scale_bytes].view(torch.float32))
        all_gather(codes.view(-1), codes[rank], group).wait()
        all_gather(scales.view(-1), scales[rank], group).wait()
        rows = torch.cat(
            (
                scales.view(torch.uint8),
                codes,
                torch.zeros(world, layout.row_bytes - layout.scale_bytes - layout.code_bytes, dtype=torch.uint8),
            ),
            dim=1,
        )
        full.view(world, -1).copy_(dequantize_rows(rows, shard, BLOCK, 8, torch.bfloat16))

    bucket = torch.randn(world * shard).to(torch.bfloat16)
    out = torch.empty(shard, dtype=torch.bfloat16)
    scratch = torch.empty_like(bucket)
    nodes = build_node_groups(list(range(world)), ranks_per_node, timedelta(minutes=5), with_inter=True)
    assert nodes.inter is not None
    int4 = HierarchicalReduceScatter(nodes.intra, nodes.inter, 4, BLOCK)
    int8 = HierarchicalReduceScatter(nodes.intra, nodes.inter, 8, BLOCK)
    return {
        "all_gather bf16": lambda: all_gather(full, mine, group).wait(),
        "int8 packed": lambda: quantized_all_gather(full, mine, group, BLOCK).wait(),
        "int8 codes + scales": two_gathers,
        "reduce_scatter bf16": lambda: reduce_scatter(out, bucket, group, scratch=scratch).wait(),
        "hierarchical int4": lambda: int4(out, bucket, group).wait(),
        "hierarchical int8": lambda: int8(out, bucket, group).wait(),
    }


def _measure(rank: int, world: int, shard: int, ranks_per_node: int, repeats: int, warmup: int) -> dict[str, Any]:
    times: dict[str, list[float]] = {}
    for name, op in _ops(shard, world, ranks_per_node).items():
        for i in range(warmup + repeats):
            dist.barrier()
            start = time.perf_counter()
            op()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i >= warmup:
                times.setdefault(name, []).append(float(elapsed))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--shard", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    run = bench.run_ranks(
        _measure, args.world_size, (args.shard, args.ranks_per_node, args.repeats, args.warmup), idle_wait=30
    )
    times = run.results[0]
    print(
        f"shard {args.shard:,} bf16 elements per rank, {args.world_size} ranks, {args.ranks_per_node} per node, "
        f"block {BLOCK}; other processes used {run.other_cpu_cores:.2f} cores meanwhile\n"
    )
    rows = [[name, f"{statistics.median(t) * 1e3:.1f}", f"{min(t) * 1e3:.1f}"] for name, t in times.items()]
    print(bench.markdown_table(["op", "median ms", "min ms"], rows))
    if args.out is not None:
        args.out.write_text(
            json.dumps(
                {
                    "args": vars(args) | {"out": str(args.out)},
                    "machine": bench.machine_info(),
                    "other_cpu_cores": run.other_cpu_cores,
                    "seconds": times,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
