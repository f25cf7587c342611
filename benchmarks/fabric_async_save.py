"""What ``fabric.save`` costs the training thread of a Fabric loop, synchronous against ``ZeroConfig.async_save`` (Note
[asynchronous saves in a Fabric loop]): a GPT (``--model small``: 3.3M parameters; ``bench25m``: 25M) in fp32 with
AdamW at stage 2 on 2 CPU ranks, ``--batch`` x 128 tokens per rank.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/fabric_async_save.py [--model small] [--rounds 6]

Paired and interleaved in one loop, so that the machine's drift cancels: one strategy with ``async_save=True``; each
round takes 3 training steps, then a synchronous save (the writer set aside for that one save, so the same loop and
state write through ``save_sharded_checkpoint``) and, 3 steps later, an asynchronous one, the order alternating from
round to round. Measured per save: the training thread's wall time inside ``fabric.save``; for an asynchronous save
also the time until the write is committed (waited for at once). Prints the medians and the ratio per round.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402

from lightning_zero import ZeroFabricStrategy  # noqa: E402
from lightning_zero.models.gpt import GPT, GPTConfig  # noqa: E402
from tests.harness import run_distributed  # noqa: E402


def _rank(model_name: str, batch: int, rounds: int, root: str) -> dict[str, Any]:
    strategy = ZeroFabricStrategy(stage=2, async_save=True)
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=2)
    fabric.launch()
    torch.manual_seed(0)
    config = getattr(GPTConfig, model_name)(block_size=128)
    model = fabric.setup_module(GPT(config))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-4))
    model.mark_forward_method("loss")
    generator = torch.Generator().manual_seed(fabric.global_rank)
    tokens = torch.randint(0, config.vocab_size, (batch, 129), generator=generator)

    def steps(n: int) -> None:
        for _ in range(n):
            fabric.backward(model.loss(tokens[:, :-1], tokens[:, 1:]))
            optimizer.step()
            optimizer.zero_grad()

    def save(kind: str, i: int) -> float:
        state = {"model": model, "optimizer": optimizer, "round": i}
        saver = strategy.saves.saver
        if kind == "sync":
            strategy.saves.wait()
            strategy.saves.saver = None  # this save writes synchronously
        start = time.perf_counter()
        try:
            fabric.save(f"{root}/{kind}-{i % 2}", state)
        finally:
            strategy.saves.saver = saver
        return time.perf_counter() - start

    steps(3)  # warm-up: the optimizer state exists, the writer process and staging memory are made by a first save
    save("async", 1)
    strategy.saves.wait()
    results: dict[str, list[float]] = {"sync": [], "async": [], "async_committed": []}
    for i in range(rounds):
        order = ("sync", "async") if i % 2 == 0 else ("async", "sync")
        for kind in order:
            steps(3)
            begun = time.perf_counter()
            results[kind].append(save(kind, i))
            if kind == "async":  # waited for at once: the write's own duration, without training beside it
                strategy.saves.wait()
                results["async_committed"].append(time.perf_counter() - begun)
    strategy.teardown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small", choices=["small", "bench25m"])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        ranks = run_distributed(
            _rank, 2, args.model, args.batch, args.rounds, root, init_process_group=False, timeout=1800
        )
    for rank, results in enumerate(ranks):
        ratios = [a / s for a, s in zip(results["async"], results["sync"], strict=True)]
        print(
            f"rank {rank}: in fabric.save, sync median {1e3 * statistics.median(results['sync']):.0f} ms, "
            f"async median {1e3 * statistics.median(results['async']):.0f} ms "
            f"(committed after {1e3 * statistics.median(results['async_committed']):.0f} ms); async/sync per round "
            + ", ".join(f"{r:.3f}" for r in ratios)
            + f"; median {statistics.median(ratios):.3f}"
        )


if __name__ == "__main__":
    main()
