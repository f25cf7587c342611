"""A training job that injects one fault on one rank, for ``tests/test_reliability_faults.py``.

Run one process per rank, as torchrun does (the test starts them and sets RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT)::

    RANK=0 LOCAL_RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \
        python tests/jobs/fault_job.py --fault raise --out /tmp/job --stage 2 --timeout 10

Rank ``--fault-rank`` injects ``--fault`` at training step ``--at-step`` after writing the wall-clock time to
``OUT/fault_time``; every rank writes ``OUT/rank<r>.started`` once training runs.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroStrategy
from lightning_zero.comm.collectives import ALL_GATHER_TAG, REDUCE_SCATTER_TAG, native_collectives
from lightning_zero.models.mlp import MLP

FAULTS = ("raise", "kill-backward", "kill-reduce-scatter", "kill-all-gather", "stop", "hang")
NATIVE_OPS = {
    "kill-reduce-scatter": ("reduce_scatter_single", "reduce_scatter_tensor"),
    "kill-all-gather": ("all_gather_single", "all_gather_into_tensor"),
}
"""The torch ops of each kill's collective on the native branch (newer and older names)."""


class FaultyMLP(pl.LightningModule):
    def __init__(self, fault: str, fault_rank: int, at_step: int, out: Path) -> None:
        super().__init__()
        self.model = MLP(in_features=16, hidden=(64, 64), out_features=4)
        self.fault, self.fault_rank, self.at_step, self.out = fault, fault_rank, at_step, out

    def _armed(self) -> bool:
        return self.global_rank == self.fault_rank and self.global_step >= self.at_step

    def _mark_fault(self) -> None:
        (self.out / "fault_time").write_text(repr(time.time()))

    def on_train_start(self) -> None:
        (self.out / f"rank{self.global_rank}.started").write_text(str(os.getpid()))
        if self.global_rank != self.fault_rank:
            return
        if self.fault == "kill-backward":
            self.model.net[0].weight.register_hook(self._kill_in_backward)
        if self.fault in NATIVE_OPS and native_collectives():
            # The native branch (Note [native collectives]) calls torch's op, looked up by name at each call.
            for name in NATIVE_OPS[self.fault]:
                if hasattr(dist, name):
                    _die_inside(name, self, None)
        elif self.fault in ("kill-reduce-scatter", "kill-all-gather"):
            # On gloo both are pairwise isend/irecv exchanges, told apart by their tags (comm/collectives.py).
            tag = REDUCE_SCATTER_TAG if self.fault == "kill-reduce-scatter" else ALL_GATHER_TAG
            _die_inside("isend", self, tag)

    def _kill_in_backward(self, grad: Tensor) -> Tensor:
        if self._armed():
            self._mark_fault()
            os.kill(os.getpid(), signal.SIGKILL)
        return grad

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        if self._armed() and self.fault in ("raise", "stop", "hang"):
            self._mark_fault()
            if self.fault == "raise":
                raise ValueError(f"injected fault on rank {self.global_rank} at step {self.global_step}")
            if self.fault == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            while self.fault == "hang":
                time.sleep(0.1)
        inputs, targets = batch
        return nn.functional.mse_loss(self.model(inputs), targets)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _die_inside(name: str, module: FaultyMLP, tag: int | None) -> None:
    """Issue the real call, then die while the peers are inside the collective it belongs to (``tag``; None: every
    call of ``name``)."""
    real = getattr(dist, name)

    def issue_then_die(*args: Any, **kwargs: Any) -> Any:
        work = real(*args, **kwargs)
        if module._armed() and (tag is None or kwargs.get("tag") == tag):
            module._mark_fault()
            os.kill(os.getpid(), signal.SIGKILL)
        return work

    setattr(dist, name, issue_then_die)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", choices=FAULTS, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800.0, help="ZeroConfig.collective_timeout_s")
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--at-step", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(4096, 16), torch.randn(4096, 4))
    trainer = pl.Trainer(
        strategy=ZeroStrategy(stage=args.stage, bucket_numel=2_000, collective_timeout_s=args.timeout),
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        max_steps=10_000,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(FaultyMLP(args.fault, args.fault_rank, args.at_step, args.out), DataLoader(data, batch_size=8))


if __name__ == "__main__":
    main()
