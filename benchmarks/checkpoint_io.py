"""Save and load time and bytes on disk of a sharded ZeRO-2 checkpoint against DDP's single-file checkpoint.

    .venv/bin/python benchmarks/checkpoint_io.py --world-size 2 --repeats 3 --out benchmarks/results/checkpoint_io.json

Both variants train the ~25M GPT (``GPTConfig.bench25m()``, fp32, AdamW) for one step under Lightning's ``Trainer``
on ``--world-size`` fresh gloo ranks (one compute thread each), so that a checkpoint holds weights and Adam state.
Then, each ``--repeats`` times, from a barrier to a barrier (so: the slowest rank):

* save: ``trainer.save_checkpoint(path)``. ZeRO: every rank writes the ranges it owns, rank 0 commits the directory.
  DDP: rank 0 ``torch.save``s the full checkpoint while the others wait.
* load: what ``trainer.fit(ckpt_path=path)`` does to the model and optimizers. ZeRO: ``strategy.load_checkpoint``
  (every rank reads the byte ranges it owns into its shards). DDP: ``strategy.load_checkpoint`` (every rank reads the
  whole file) + ``load_model_state_dict`` + ``load_optimizer_state_dict``.
* bytes on disk: the file, or every file of the directory.

Last, ``consolidate_checkpoint`` turns the ZeRO directory into one file in a fresh process without a process group;
its time and its peak RSS above the process's own baseline are reported. Files are written under ``--dir``; the page
cache is warm, so the timings are of serialization and system calls, not of a cold disk.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import _common as bench
import lightning.pytorch as pl
import torch.distributed as dist

from lightning_zero import ZeroStrategy
from lightning_zero.cli.consolidate import consolidate_checkpoint
from lightning_zero.models.gpt import GPTConfig
from lightning_zero.models.lightning_gpt import LitGPT, SyntheticTextDataModule

MiB = 2**20
VARIANTS = ("ddp", "zero2")


def bench_rank(rank: int, world_size: int, variant: str, root: str, repeats: int, batch_size: int) -> dict[str, Any]:
    # The process group exists already; these tell Lightning this rank's place in it (as torchrun's variables do).
    os.environ.update(
        LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT="0"
    )
    config = GPTConfig.bench25m()
    pl.seed_everything(1234, verbose=False)
    module = LitGPT(config)
    data = SyntheticTextDataModule(
        vocab_size=config.vocab_size, seq_len=config.block_size, batch_size=batch_size, num_train=4 * batch_size
    )
    trainer = pl.Trainer(
        strategy=ZeroStrategy(stage=2) if variant == "zero2" else "ddp",
        accelerator="cpu",
        devices=world_size,
        max_steps=1,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    trainer.fit(module, datamodule=data)
    path = f"{root}/{variant}.ckpt"
    save_s, load_s = [], []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        trainer.save_checkpoint(path)
        dist.barrier()
        save_s.append(time.perf_counter() - start)
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        checkpoint = trainer.strategy.load_checkpoint(path)
        trainer.strategy.load_model_state_dict(checkpoint)
        trainer.strategy.load_optimizer_state_dict(checkpoint)
        dist.barrier()
        load_s.append(time.perf_counter() - start)
    files = [Path(path)] if os.path.isfile(path) else [p for p in Path(path).iterdir() if p.is_file()]
    return {
        "save_s": save_s,
        "load_s": load_s,
        "files": len(files),
        "bytes": sum(p.stat().st_size for p in files),
        "parameters": sum(p.numel() for p in module.parameters()),
    }


def _consolidate_child(ckpt_dir: str, out: str, conn: Any) -> None:
    before = bench.memory_status()
    start = time.perf_counter()
    consolidate_checkpoint(ckpt_dir, out)
    elapsed = time.perf_counter() - start
    conn.send({"s": elapsed, "peak_above_baseline": bench.memory_status()["VmHWM"] - before["VmRSS"]})


def consolidate_in_fresh_process(ckpt_dir: str, out: str) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_consolidate_child, args=(ckpt_dir, out, writer))
    proc.start()
    writer.close()
    result: dict[str, float] = reader.recv()
    proc.join()
    return result


def report(results: dict[str, list[dict[str, Any]]], consolidate: dict[str, float], world_size: int) -> str:
    psi = results["zero2"][0]["parameters"]
    rows = []
    labels = {"ddp": "DDP: one file, rank 0", "zero2": f"ZeRO-2: sharded directory, {world_size} ranks"}
    for variant, ranks in results.items():
        first = ranks[0]
        rows.append(
            [
                labels[variant],
                str(first["files"]),
                f"{first['bytes'] / MiB:.1f}",
                f"{statistics.median(first['save_s']):.2f}",
                f"{statistics.median(first['load_s']):.2f}",
            ]
        )
    header = ["checkpoint", "files", "MiB on disk", "save (s)", "load (s)"]
    return "\n".join(
        [
            bench.markdown_table(header, rows),
            "",
            f"Model states: Ψ = {psi:,} fp32 parameters + AdamW's two moments = 12Ψ B = {12 * psi / MiB:.1f} MiB.",
            f"Consolidating the ZeRO directory into one file (1 process, no process group): {consolidate['s']:.2f} s, "
            f"peak RSS {consolidate['peak_above_baseline'] / MiB:.0f} MiB above the process baseline "
            f"(fp32 weights: {4 * psi / MiB:.0f} MiB).",
            "Times are medians over the repeats of the slowest rank (barrier to barrier).",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per rank in the one training step")
    parser.add_argument("--dir", type=Path, default=None, help="where checkpoints are written (default: a temp dir)")
    parser.add_argument("--idle-wait", type=float, default=120.0, help="max seconds to wait for an idle machine")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/checkpoint_io.json"))
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="checkpoint_io_", dir=ns.dir) as root:
        results: dict[str, list[dict[str, Any]]] = {}
        for variant in VARIANTS:
            args = (variant, root, ns.repeats, ns.batch_size)
            run = bench.run_ranks(bench_rank, ns.world_size, args, idle_wait=ns.idle_wait)
            results[variant] = run.results
            print(f"{variant}: done in {run.wall_s:.0f} s (other processes used {run.other_cpu_cores:.2f} cores)")
        consolidated = consolidate_in_fresh_process(f"{root}/zero2.ckpt", f"{root}/consolidated.ckpt")
    text = report(results, consolidated, ns.world_size)
    print(text)
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "machine": bench.machine_info(),
        "world_size": ns.world_size,
        "repeats": ns.repeats,
        "variants": results,
        "consolidate": consolidated,
        "report_markdown": text,
    }
    ns.out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
