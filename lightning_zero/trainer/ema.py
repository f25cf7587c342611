"""``ShardedEMA``: an exponential moving average of the weights that lives on the shards.

Lightning's ``EMAWeightAveraging`` keeps a second full model (an ``AveragedModel``) on every rank: at stages 1 and 2
it works under ZeRO at that cost (Note [Lightning's WeightAveraging] in ``strategy_checkpoint.py``), and under stage
3 there are no full parameters to average.
``ShardedEMA`` takes the same arguments and keeps the same schedule, but each rank averages only the fp32 slice it
owns (its ``ZeroOptimizer``'s masters): 4Ψ/N bytes per rank and no communication per step, under every stage.

Note [averages in the tiers]
With memory tiers (``ZeroConfig.offload_optimizer="disk"``) the masters and optimizer state, the average with them,
live in the tier between steps. Each update then loads one bucket's masters and averages only (not its gradients,
the rest of its optimizer state or, under mixed precision, its parameter shard; nothing read ahead for the step),
averages them and lets the tier write the averages back, so memory stays a few buckets and an update reads what
it averages; swapping the whole model (validation, the end of fit) holds every shard in memory for its duration
(``ZeroStrategy.shards_in_memory``); a checkpoint save or load does not, it streams through the tiers one slice at
a time.

Note [EMA as optimizer state]
The average of a master is kept as one more element-wise optimizer state entry, ``optimizer.state[master]["ema"]``,
next to Adam's moments. The sharded checkpoint already saves, loads and reshards every element-wise state tensor
(``checkpoint/slices.py``), so the EMA is saved with the shards, restored on resume at any world size or stage, and
``python -m lightning_zero consolidate --weights ema`` exports it, with no code of its own. The entry is created at
the first update, after an optimizer step: optimizers such as Adam initialize their state only when it is empty,
so an entry added before their first step would stop them from creating theirs.

Swapping (validation during fit): the live masters are set aside (4Ψ/N), the EMA is written into the masters and
their parameter shards, and the parameters are re-gathered (stages 1 and 2 all-gather the buckets; stage 3 gathers
units from the shards as it runs them); afterwards the live masters are written back the same way. The parameters
are always a copy of the masters (rounded to bf16/fp16 under mixed precision), so the restore is exact.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from typing_extensions import override

from lightning_zero.comm.collectives import all_gather
from lightning_zero.sharding.sharded_optimizer import ZeroOptimizer
from lightning_zero.trainer.strategy import ZeroStrategy
from lightning_zero.trainer.strategy_checkpoint import iter_zero_optimizers

EMA_KEY = "ema"
"""The optimizer state entry holding a master's average (Note [EMA as optimizer state])."""


class ShardedEMA(pl.Callback):
    """Exponential moving average of the weights, kept on the shards: ``Trainer(callbacks=[ShardedEMA(0.999)])``.

    After every update ``ema = decay * ema + (1 - decay) * weights`` (the first update copies the weights), as
    Lightning's ``EMAWeightAveraging``. The average replaces the weights during validation in fit and is copied into
    the model when training ends. Only trainable parameters are averaged (frozen ones do not change); buffers are
    not (``EMAWeightAveraging(use_buffers=False)``). Before the first update, validation sees the live weights.

    Args:
        decay: weight of the old average in each update, in [0, 1).
        update_every_n_steps: update after optimizer steps whose zero-based index is a multiple of this.
        update_starting_at_step: first zero-based optimizer step index that updates; None: from the first.
        update_starting_at_epoch: also update at the end of every epoch from this one on; None: never at epoch ends.
    """

    def __init__(
        self,
        decay: float = 0.999,
        update_every_n_steps: int = 1,
        update_starting_at_step: int | None = None,
        update_starting_at_epoch: int | None = None,
    ) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"Invalid ShardedEMA.decay: {decay!r}. Expected a float in [0, 1), such as 0.999.")
        if update_every_n_steps < 0:
            raise ValueError(
                f"Invalid ShardedEMA.update_every_n_steps: {update_every_n_steps!r}. Expected an int >= 1 (0: never "
                "after a step)."
            )
        self.decay = decay
        self.update_every_n_steps = update_every_n_steps
        self.update_starting_at_step = update_starting_at_step
        self.update_starting_at_epoch = update_starting_at_epoch
        self._latest_update_step = 0
        self._latest_update_epoch = -1
        self._live: list[list[Tensor]] | None = None  # the live masters while the EMA is swapped in

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        """As ``EMAWeightAveraging.should_update``: whether to update after this zero-based step or epoch."""
        if step_idx is not None:
            started = self.update_starting_at_step is None or step_idx >= self.update_starting_at_step
            if started and self.update_every_n_steps > 0 and step_idx % self.update_every_n_steps == 0:
                return True
        return (
            epoch_idx is not None
            and self.update_starting_at_epoch is not None
            and epoch_idx >= self.update_starting_at_epoch
        )

    # -- the schedule (as Lightning's WeightAveraging) --------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not isinstance(trainer.strategy, ZeroStrategy):
            raise TypeError(
                f"ShardedEMA averages the shards of a ZeroStrategy, but the Trainer's strategy is "
                f"{type(trainer.strategy).__name__}. HINT: use strategy='zero1'/'zero2'/'zero3', or Lightning's "
                "`EMAWeightAveraging` with other strategies."
            )

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step_idx = trainer.global_step - 1  # zero-based, as Lightning's callback counts
        if trainer.global_step > self._latest_update_step and self.should_update(step_idx=step_idx):
            self._update(trainer)
            self._latest_update_step = trainer.global_step

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        epoch = trainer.current_epoch
        if epoch > self._latest_update_epoch and self.should_update(epoch_idx=epoch):
            self._update(trainer)
            self._latest_update_epoch = epoch

    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "fit" and self._live is None and _has_ema(trainer):
            with _resident(trainer):
                self._live = [[m.detach().clone() for m in zero.masters] for zero in _zeros(trainer)]
                _write_masters(trainer, [_emas(zero) for zero in _zeros(trainer)])

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._live is not None:
            live, self._live = self._live, None
            with _resident(trainer):
                _write_masters(trainer, live)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # As EMAWeightAveraging: the model leaves fit with the averaged weights.
        if _has_ema(trainer):
            with _resident(trainer):
                _write_masters(trainer, [_emas(zero) for zero in _zeros(trainer)])

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Interrupted during validation: put the live weights back into the masters and shards (what a checkpoint
        # saves), without a collective: another rank may be the one that failed.
        if self._live is not None:
            live, self._live = self._live, None
            with _resident(trainer):  # local reads and writes only
                _write_masters(trainer, live, gather=False)

    @override
    def state_dict(self) -> dict[str, Any]:
        # The average itself is optimizer state (Note [EMA as optimizer state]); only the schedule is here.
        return {"latest_update_step": self._latest_update_step, "latest_update_epoch": self._latest_update_epoch}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._latest_update_step = state_dict["latest_update_step"]
        self._latest_update_epoch = state_dict.get("latest_update_epoch", -1)

    # -- the average --------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _update(self, trainer: pl.Trainer) -> None:
        for zero in _zeros(trainer):
            if zero.tiers is None:
                self._update_masters(zero, list(zero.masters))
                continue
            # Note [averages in the tiers]: bucket by bucket, each resident only while it is averaged.
            for bucket in zero.buckets:
                masters = [m for seg, m in zip(zero.segments, zero.masters, strict=True) if seg.bucket is bucket]
                zero.tiers.load(bucket, only=(EMA_KEY,))  # no gradient, no other state
                try:
                    self._update_masters(zero, masters)
                finally:
                    zero.tiers.unload(bucket)

    def _update_masters(self, zero: ZeroOptimizer, masters: list[Tensor]) -> None:
        pairs = [(zero.state[m], m) for m in masters]
        averaged = [(s[EMA_KEY], m) for s, m in pairs if EMA_KEY in s]
        for state, master in pairs:
            if EMA_KEY not in state:  # the first update copies, as AveragedModel's does
                state[EMA_KEY] = master.detach().clone()
        if averaged:
            emas, masters = [e for e, _ in averaged], [m for _, m in averaged]
            # decay * ema + (1 - decay) * weights, as torch's get_ema_avg_fn; one fused call per optimizer.
            torch._foreach_mul_(emas, self.decay)
            torch._foreach_add_(emas, masters, alpha=1.0 - self.decay)


def _resident(trainer: pl.Trainer) -> AbstractContextManager[None]:
    """Every shard in memory for a swap of the whole model (Note [averages in the tiers])."""
    strategy = trainer.strategy
    return strategy.shards_in_memory() if isinstance(strategy, ZeroStrategy) else nullcontext()


def _zeros(trainer: pl.Trainer) -> list[ZeroOptimizer]:
    return list(iter_zero_optimizers(trainer.strategy.optimizers))


def _has_ema(trainer: pl.Trainer) -> bool:
    # Every rank updates at the same steps, so every rank answers the same and joins the same gathers.
    return any(EMA_KEY in zero.state.get(m, {}) for zero in _zeros(trainer) for m in zero.masters)


def _emas(zero: ZeroOptimizer) -> list[Tensor]:
    return [zero.state[m][EMA_KEY] for m in zero.masters]


@torch.no_grad()
def _write_masters(trainer: pl.Trainer, values: list[list[Tensor]], gather: bool = True) -> None:
    """Set every optimizer's masters to ``values``, then the parameter shards and (``gather``) the full parameters
    from them."""
    for zero, new in zip(_zeros(trainer), values, strict=True):
        if zero.masters:
            torch._foreach_copy_(zero.masters, new)
        for segment, master in zip(zero.segments, zero.masters, strict=True):
            shard = segment.bucket.param_shard[segment.start : segment.stop]
            if master.data_ptr() != shard.data_ptr():
                shard.copy_(master)  # fp32 master -> low-precision parameter shard
        if not gather:
            continue
        with _gathering() as pending:
            for bucket in zero.resident_buckets:
                assert bucket.data is not None
                # Not in the optimizer's ledger: this is not a training step's traffic.
                pending.append(all_gather(bucket.data, bucket.param_shard, zero.group))
        if zero.gatherer is not None:
            zero.gatherer.refresh_gathered()  # stage 3: no unit keeps the weights it gathered before


@contextmanager
def _gathering() -> Iterator[list[Any]]:
    pending: list[Any] = []
    try:
        yield pending
    finally:
        for p in pending:
            p.wait()
