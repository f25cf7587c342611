"""Train the example GPT with ZeRO in a plain Lightning Fabric loop, on two CPU processes.

    .venv/bin/python examples/fabric_train.py

trains the small GPT (3.3M parameters) on the shipped fables (``data/fables.txt``) with ``Fabric(strategy="zero3")``
on two CPU processes: the model is built on the meta device and materialized shard by shard, gradients accumulate
over micro-batches without communication, the gradient norm is clipped, and a sharded checkpoint (the Trainer's
format) is written at the end and resumed from when it exists. Options::

    .venv/bin/python examples/fabric_train.py --strategy zero1 --steps 200 --precision bf16-mixed
    .venv/bin/python examples/fabric_train.py --strategy ddp --model tiny     # Fabric's own DDP, for comparison
    .venv/bin/python examples/fabric_train.py --checkpoint ckpt/fabric --steps 20   # again: resumes at step 20

Launched by Fabric's command line (``fabric run`` with ZeRO's names), the launcher's options set the accelerator,
devices, strategy and precision (the script's ``Fabric()`` reads them)::

    .venv/bin/python -m lightning_zero fabric-run --strategy zero3 --accelerator cpu --devices 2 \\
        examples/fabric_train.py --model tiny --steps 20
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_zero import ZeroFabricStrategy  # importing lightning_zero registers "zero1".."zero3" with Fabric
from lightning_zero.models.data import ByteCorpusDataModule, decode, encode
from lightning_zero.models.gpt import GPT, GPTConfig
from lightning_zero.models.param_groups import param_groups_with_weight_decay

REPO = Path(__file__).resolve().parent.parent


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="zero3", help='"zero1".."zero3", "ddp", ...')
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--model", choices=("tiny", "small"), default="small")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-norm", type=float, default=1.0)
    parser.add_argument("--checkpoint", default=None, help="a directory to resume from and save to")
    parser.add_argument("--print-every", type=int, default=10)
    return parser.parse_args()


def main() -> None:
    args = parse()
    if os.environ.get("LT_CLI_USED"):  # `fabric-run` chose the options and started the processes
        fabric = Fabric()
    else:
        fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=args.strategy, precision=args.precision)
        fabric.launch()
    fabric.seed_everything(1234)
    fabric.print(f"{type(fabric.strategy).__name__} on {fabric.world_size} processes")

    data = ByteCorpusDataModule(path=REPO / "data" / "fables.txt", seq_len=64, batch_size=args.batch_size)
    loader = fabric.setup_dataloaders(data.train_dataloader())
    config = getattr(GPTConfig, args.model)(vocab_size=data.vocab_size, block_size=64)

    # Stage 3 builds on meta, as Fabric's FSDP does: no rank ever holds the whole model (setup_module materializes
    # and initializes it shard by shard). Elsewhere `empty_init=True` would leave the weights uninitialized.
    stage3 = isinstance(fabric.strategy, ZeroFabricStrategy) and fabric.strategy.config.stage == 3
    with fabric.init_module(empty_init=stage3):
        model = GPT(config)
    model = fabric.setup_module(model)
    optimizer = torch.optim.AdamW(param_groups_with_weight_decay(model, 0.1), lr=3e-3, betas=(0.9, 0.95))
    optimizer = fabric.setup_optimizers(optimizer)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(args.steps, 1))
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    if args.checkpoint is not None and Path(args.checkpoint).exists():
        fabric.load(args.checkpoint, state)
        fabric.print(f"resumed from {args.checkpoint} at step {state['step']}")

    batches = iter(loader)
    started = time.perf_counter()
    while state["step"] < args.steps:
        total = 0.0
        for micro in range(args.accumulate):
            try:
                inputs, targets = next(batches)
            except StopIteration:
                batches = iter(loader)
                inputs, targets = next(batches)
            # No gradient communication until the last micro-batch of the step.
            with fabric.no_backward_sync(model, enabled=micro < args.accumulate - 1):
                logits = model(inputs.long())
                loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.long().flatten())
                fabric.backward(loss / args.accumulate)
            total += loss.item() / args.accumulate
        norm = fabric.clip_gradients(model, optimizer, max_norm=args.max_norm)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        state["step"] += 1
        mean = fabric.all_reduce(torch.tensor(total), reduce_op="mean")
        if state["step"] % args.print_every == 0 or state["step"] == args.steps:
            fabric.print(f"step {state['step']:4d}/{args.steps}  loss {float(mean):.4f}  grad norm {float(norm):.3f}")

    fabric.print(f"{args.steps} steps in {time.perf_counter() - started:.1f} s on {fabric.world_size} processes")
    throughput = fabric.strategy.throughput() if isinstance(fabric.strategy, ZeroFabricStrategy) else None
    if throughput is not None:  # samples, tokens and FLOPs per second (torch's formulas on the first step), MFU
        fabric.print(throughput.describe())
        fabric.log_dict(throughput.metrics(), step=state["step"])
    if args.checkpoint is not None:
        fabric.save(args.checkpoint, state)
        fabric.print(f"saved {args.checkpoint}")
    sample(fabric, model)


@torch.no_grad()
def sample(fabric: Fabric, model: Any, tokens: int = 48) -> None:
    """Greedy continuation of a prompt; every rank runs it (stage 3 gathers each unit for the forward)."""
    idx = encode("The fox ").unsqueeze(0)
    for _ in range(tokens):
        logits = model(idx[:, -64:])
        idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    fabric.print(repr(decode(idx[0])))


if __name__ == "__main__":
    main()
