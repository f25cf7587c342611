"""What adopting edits without a host read costs a mixed-precision step (Note [edits reach the masters] in
``lightning_zero/sharding/param_edits.py``): per step, the masked copy ``adopt_edits`` runs over every run of fp32
masters on the device, against deciding on the host (each bucket's shard compared with its rounded masters, the
flags read with ``.tolist()``, the copy only where a flag is set; no parameter edited here, so none is). Paired
interleaved rounds in one process, the median of each; on CUDA each round ends with a synchronize, so its time is the
device's, and the host read's wait is in the reference's.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/edit_check.py --elements 21000000 --bucket 4000000
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks._common import synchronize
from lightning_zero.sharding.flat_bucket import FlatBucket
from lightning_zero.sharding.param_groups import MasterRun, adopt_edits


def _runs(elements: int, bucket: int, device: torch.device) -> list[MasterRun]:
    """Runs of one bucket each: a bf16 parameter shard and its fp32 masters, rounded into it as after a step."""
    runs = []
    for start in range(0, elements, bucket):
        numel = min(bucket, elements - start)
        param = torch.nn.Parameter(torch.empty(numel, dtype=torch.bfloat16, device=device))
        flat = FlatBucket(0, 0, [("p", param)], 0, 1)
        master = torch.randn(flat.param_shard.numel(), device=device)
        flat.param_shard.copy_(master)
        runs.append(MasterRun(flat, 0, master.numel(), master))
    return runs


def _decided_on_the_host(runs: list[MasterRun]) -> None:
    """The check before: one flag per bucket, read on the host; the copy only for the flagged."""
    flags = torch.stack([(run.shard != run.master.to(run.shard.dtype)).any() for run in runs]).tolist()
    edited = [run for run, flag in zip(runs, flags, strict=True) if flag]
    if edited:
        adopt_edits(edited)


def _masked_copy(runs: list[MasterRun]) -> None:
    for run in runs:
        adopt_edits([run])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elements", type=int, default=21_000_000, help="elements of the shard")
    parser.add_argument("--bucket", type=int, default=4_000_000, help="elements per bucket (one run each)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    runs = _runs(args.elements, args.bucket, device)
    variants: dict[str, Callable[[list[MasterRun]], None]] = {
        "decided on the host (a read per step)": _decided_on_the_host,
        "masked copy (no read)": _masked_copy,
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():  # warm-up: allocator, kernels
        fn(runs)
    synchronize(device)
    for round_ in range(args.rounds):
        order = list(variants.items()) if round_ % 2 == 0 else list(variants.items())[::-1]
        for name, fn in order:
            start = time.perf_counter()
            fn(runs)
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    print(f"{args.elements} elements in buckets of {args.bucket}, {device}, {args.rounds} paired rounds:")
    for name, seconds in times.items():
        print(f"  {name}: median {statistics.median(seconds) * 1e3:.2f} ms")
    new, old = (statistics.median(times[name]) for name in ("masked copy (no read)", next(iter(variants))))
    print(f"  masked copy / decided on the host: {new / old:.2f}")


if __name__ == "__main__":
    main()
