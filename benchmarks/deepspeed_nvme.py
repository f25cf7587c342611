"""DeepSpeed ZeRO-Infinity (stage 3, parameters and optimizer state on NVMe) as a peer of ``largest_model.py``.

    DS_ACCELERATOR=cpu /work/ds-venv/bin/python benchmarks/deepspeed_nvme.py --n-layer 12 --n-embd 2048 \
        --nvme-dir /work/ds-offload

Runs in a virtualenv of its own, never as a dependency of this package: ``torch`` (the same version) and ``deepspeed``
installed there, ``libaio-dev`` from the system's packages; DeepSpeed builds its ``cpu_adam`` and ``async_io`` ops on
first use (minutes). The same GPT (``lightning_zero/models/gpt.py``, loaded by path: nothing else of this package is
imported), the same data (one fixed arithmetic-progression sequence per rank, ``SyntheticTokenDataset``'s seed-0
items 0 and 1), fp32 AdamW (lr 1e-3, betas 0.9/0.95, weight decay 0.1 on matrices and embeddings, as ``LitGPT``),
2 ranks on gloo, batch 1, seq 128, 3 steps, and the same memory guard (``memory_guard.py``: the two ranks' RSS
within ``--budget-gb``, the machine's MemAvailable above ``--margin-gib``).

The configuration is the one that makes DeepSpeed keep its parameters on disk on a CPU-only machine (defaults keep
every partition below 1e9 elements in RAM and never release parameters between forward and backward):
``offload_param.max_in_cpu = 0``, ``stage3_max_reuse_distance = 0``, a 50M-element reduce bucket.

Per rank: loss per step, step time, peak RSS per step (``VmHWM`` reset each step), the bytes the process read from
and wrote to the disk per step (``/proc/self/io``: DeepSpeed's swapping uses direct IO, so this is its traffic), and
the disk space its swap files took. Appends to ``benchmarks/results/largest_model_deepspeed.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType
from typing import Any

from memory_guard import GB, GIB, run_guarded, wait_for_memory

HERE = Path(__file__).parent
RESULTS = HERE / "results" / "largest_model_deepspeed.json"
MODELS = HERE.parent / "lightning_zero" / "models"
SEQ, VOCAB, STEPS = 128, 8192, 3
RUN_DIR = "DEEPSPEED_NVME_RUN_DIR"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_peer_{name}", MODELS / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building the class
    spec.loader.exec_module(module)
    return module


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    return 0


def _proc_io() -> tuple[int, int]:
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def _disk_usage(directory: Path) -> int:
    return sum(f.stat().st_blocks * 512 for f in directory.rglob("*") if f.is_file())


def ds_config(nvme: Path) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {
                "device": "nvme",
                "nvme_path": str(nvme),
                "max_in_cpu": 0,
                "buffer_count": 16,
                "buffer_size": 14_000_000,
            },
            "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme)},
            "stage3_max_reuse_distance": 0,
            "reduce_bucket_size": 50_000_000,
            "sub_group_size": 20_000_000,
        },
        "steps_per_print": 1_000_000,
    }


def rank_main(args: argparse.Namespace, run_dir: Path) -> None:
    import deepspeed
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    gpt, groups = _load("gpt"), _load("param_groups")
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    cfg = ds_config(run_dir)
    config = gpt.GPTConfig(
        vocab_size=VOCAB, block_size=SEQ, n_layer=args.n_layer, n_head=args.n_embd // 128, n_embd=args.n_embd
    )
    start = time.perf_counter()
    with deepspeed.zero.Init(remote_device="nvme", config_dict_or_path=cfg):
        model = gpt.GPT(config)
    params = sum(p.ds_numel for p in model.parameters())
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=groups.param_groups_with_weight_decay(model, 0.1), config=cfg
    )
    setup_s = time.perf_counter() - start
    setup_peak = _status("VmHWM:")
    # SyntheticTokenDataset(num_samples=2, seed=0)[rank]: an arithmetic progression mod the vocabulary.
    generator = torch.Generator().manual_seed(0)
    starts = torch.randint(0, VOCAB, (2,), generator=generator)
    strides = torch.randint(1, 9, (2,), generator=generator)
    tokens = (starts[rank] + strides[rank] * torch.arange(SEQ + 1)) % VOCAB
    inputs, targets = tokens[:-1].unsqueeze(0), tokens[1:].unsqueeze(0)
    losses, times, step_peaks, io = [], [], [], []
    for _ in range(STEPS):
        Path("/proc/self/clear_refs").write_text("5")
        io0, t0 = _proc_io(), time.perf_counter()
        logits = engine(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        io1 = _proc_io()
        io.append((io1[0] - io0[0], io1[1] - io0[1]))
        step_peaks.append(_status("VmHWM:"))
        losses.append(float(loss.detach()))
    result = {
        "rank": rank,
        "params": params,
        "losses": losses,
        "step_s": times,
        "setup_s": setup_s,
        "peak_rss_bytes": max([setup_peak, *step_peaks]),
        "setup_peak_rss_bytes": setup_peak,
        "step_peak_rss_bytes": step_peaks,
        "disk_bytes_per_step": io,
        "swap_dir_bytes": _disk_usage(run_dir) if rank == 0 else None,
    }
    (run_dir / f"result-rank{rank}.json").write_text(json.dumps(result))


def guarded_run(args: argparse.Namespace) -> None:
    budget, margin = int(args.budget_gb * GB), int(args.margin_gib * GIB)
    wait_for_memory(int((args.wait_gb or args.budget_gb) * GB) + margin, timeout=1800.0)
    run_dir = Path(args.nvme_dir) / f"deepspeed-nvme-{os.getpid()}"
    run_dir.mkdir(parents=True)
    env = {
        **os.environ,
        RUN_DIR: str(run_dir),
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "MALLOC_MMAP_THRESHOLD_": "65536",
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", __file__, *sys.argv[1:]]
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    try:
        guard = run_guarded(command, budget=budget, margin=margin, env=env)
        ranks = [json.loads(p.read_text()) for p in sorted(run_dir.glob("result-rank*.json"))]
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    import deepspeed

    record: dict[str, Any] = {
        "deepspeed": deepspeed.__version__,
        "n_layer": args.n_layer,
        "n_embd": args.n_embd,
        "date": started,
        "budget_bytes": budget,
        "margin_bytes": margin,
        "job_peak_rss_bytes": guard.peak_rss_bytes,
        "min_mem_available_bytes": guard.min_mem_available_bytes,
        "wall_s": round(guard.wall_s, 1),
        "ranks": ranks,
    }
    if guard.stopped is not None or len(ranks) != 2:
        record["fits"] = False
        record["verdict"] = guard.describe()
    else:
        peaks = sum(r["peak_rss_bytes"] for r in ranks)
        trains = all(all(map(math.isfinite, r["losses"])) and r["losses"][-1] < r["losses"][0] for r in ranks)
        record["fits"] = trains and peaks <= budget
        record["verdict"] = (
            f"the two ranks' peaks add up to {peaks / GB:.2f} GB of the {budget / GB:.1f} GB budget; loss "
            f"{'finite and falling' if trains else 'NOT finite and falling'}"
        )
    print(record["verdict"], flush=True)
    with open(RESULTS, "a") as out:
        out.write(json.dumps(record) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-layer", type=int, required=True)
    parser.add_argument("--n-embd", type=int, required=True)
    parser.add_argument("--nvme-dir", default="/tmp/deepspeed_nvme", help="the run's swap directory goes here")
    parser.add_argument("--budget-gb", type=float, default=20.0, help="the two ranks' RSS together may not exceed this")
    parser.add_argument("--margin-gib", type=float, default=1.5, help="stop the run if MemAvailable falls below this")
    parser.add_argument("--wait-gb", type=float, help="start once this + the margin is free (default: the budget)")
    args = parser.parse_args()
    if RUN_DIR in os.environ:
        rank_main(args, Path(os.environ[RUN_DIR]))
    else:
        guarded_run(args)


if __name__ == "__main__":
    main()
