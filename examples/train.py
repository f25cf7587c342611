"""Train a small GPT with ZeRO on two CPU processes.

    .venv/bin/python examples/train.py                       # ZeRO stage 2, 2 processes, 60 steps
    .venv/bin/python examples/train.py --strategy zero1 --max-steps 200

Each process holds the full model but only half of the optimizer state (stage 1) and of the gradients (stage 2).
At the end every rank prints its model-state bytes and the bytes it communicated in the last step.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl

import lightning_zero  # noqa: F401  (registers the "zero1" / "zero2" strategies)
from lightning_zero import ZeroStrategy
from lightning_zero.models.gpt import GPTConfig
from lightning_zero.models.lightning_gpt import LitGPT, SyntheticTextDataModule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="zero2", choices=["zero1", "zero2", "ddp"])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    pl.seed_everything(0)
    config = GPTConfig.tiny()
    model = LitGPT(config, lr=args.lr)
    data = SyntheticTextDataModule(vocab_size=config.vocab_size, seq_len=config.block_size, batch_size=args.batch_size)
    trainer = pl.Trainer(
        strategy=args.strategy,
        accelerator="cpu",
        devices=args.devices,
        max_steps=args.max_steps,
        log_every_n_steps=10,
        enable_checkpointing=False,
        logger=False,
    )
    trainer.fit(model, data)

    strategy = trainer.strategy
    if isinstance(strategy, ZeroStrategy):
        state = strategy.model_state_bytes()
        print(
            f"[rank {trainer.global_rank}] loss {float(trainer.callback_metrics['train_loss']):.3f} | "
            f"params {state.parameters:,} B, grads {state.gradients:,} B, optimizer state {state.optimizer_state:,} B"
            f" | last step sent {strategy.communication_per_step()}"
        )


if __name__ == "__main__":
    main()
