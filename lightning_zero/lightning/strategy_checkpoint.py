"""The checkpoint hooks of ``ZeroStrategy``: a sharded directory per checkpoint, written and read by every rank.

``ShardedCheckpointing`` routes Lightning's checkpoint hooks to ``lightning_zero.checkpoint``; ``ZeroStrategy``
(``strategy.py``) inherits them and adds everything else.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.checkpoint.files import remove
from lightning_zero.checkpoint.sharded_checkpoint import (
    load_checkpoint,
    save_sharded_checkpoint,
    sharded_model_state,
    sharded_optimizer_state,
)
from lightning_zero.config import ZeroConfig
from lightning_zero.offload.memory_tiers import MemoryTiers
from lightning_zero.sharding.sharded_optimizer import ZeroOptimizer
from lightning_zero.stage3.parameter_gatherer import ParameterGatherer


class ShardedCheckpointing(ParallelStrategy):
    """Lightning's checkpoint hooks for a strategy whose optimizers are ``ZeroOptimizer``s."""

    config: ZeroConfig
    _tiers: MemoryTiers | None
    """The memory tiers; a save or load brings every shard of this rank into memory for its duration."""
    _gatherer: ParameterGatherer | None
    """Stage 3's sharded model; None for stages 1 and 2."""

    @property
    def process_group(self) -> dist.ProcessGroup:
        group = dist.group.WORLD
        assert group is not None, "the process group is created in setup_environment()"
        return group

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # checkpoints load straight into the optimizer shards, which setup() creates

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        if self._tiers is not None:
            self._tiers.load_all()  # until save_checkpoint() has written them
        return sharded_model_state(self.lightning_module, list(iter_zero_optimizers(self.optimizers)), self._gatherer)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        zero_optimizers = list(iter_zero_optimizers(self.optimizers))
        return sharded_optimizer_state(zero_optimizers, zero_optimizers.index(as_zero_optimizer(optimizer)))

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Every rank writes what it owns into the directory ``filepath``; call it on every rank."""
        if storage_options is not None:
            raise TypeError(
                f"ZeroStrategy.save_checkpoint(storage_options={storage_options!r}) is not supported: sharded "
                "checkpoints are written by every rank, not through a CheckpointIO plugin. HINT: drop storage_options."
            )
        saved_with = {"world_size": self.world_size, "stage": self.config.stage}
        try:
            save_sharded_checkpoint(checkpoint, self.broadcast(filepath), self.process_group, saved_with)
        finally:
            if self._tiers is not None:
                self._tiers.unload_all()

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a sharded directory (any world size or stage) or a full ``.ckpt`` file into this rank's shards.

        Always as ``weights_only=True`` would (see Note [safe loading] in ``checkpoint/files.py``).
        """
        module = self.lightning_module
        assert module is not None
        if self._tiers is not None:
            self._tiers.load_all()
        try:
            return load_checkpoint(
                self.broadcast(checkpoint_path),
                module,
                list(iter_zero_optimizers(self.optimizers)),
                self.process_group,
                load_optimizer=module.trainer.state.fn == TrainerFn.FITTING,
                strict=module.strict_loading,
                gatherer=self._gatherer,
            )
        finally:
            if self._tiers is not None:
                self._tiers.unload_all()  # what was loaded goes to its tier

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # load_checkpoint() already wrote the weights into this rank's shards

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # likewise for the optimizer state

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            remove(filepath)


def as_zero_optimizer(optimizer: Any) -> ZeroOptimizer:
    # LightningOptimizer wraps the strategy's optimizer in manual optimization.
    optimizer = getattr(optimizer, "_optimizer", optimizer)
    if not isinstance(optimizer, ZeroOptimizer):
        raise TypeError(
            f"ZeroStrategy expected a ZeroOptimizer but got {type(optimizer).__name__}. HINT: do not replace "
            "`trainer.optimizers` after setup; return your optimizers from `configure_optimizers`."
        )
    return optimizer


def iter_zero_optimizers(optimizers: list[Optimizer]) -> Iterator[ZeroOptimizer]:
    return (as_zero_optimizer(o) for o in optimizers)
