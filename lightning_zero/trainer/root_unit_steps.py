"""The steps of ``ZeroStrategy``: at stage 3 every step is a forward of the root unit, and ``fit``'s forwards
broadcast rank 0's buffers where DDP would.

``RootUnitSteps`` sits on top of ``ShardedCheckpointing`` (``strategy_checkpoint.py``); ``ZeroStrategy``
(``strategy.py``) inherits it. Lightning calls ``training_step`` (and the others) on the strategy, which calls the
``LightningModule``'s: the root unit (the parameters no smaller unit owns, e.g. embeddings used in the module's own
code) is gathered around it, as a unit's forward hooks gather it around the unit's forward.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_zero.engine.buffers import BufferBroadcast, broadcast_buffers
from lightning_zero.trainer.strategy_checkpoint import ShardedCheckpointing


class RootUnitSteps(ShardedCheckpointing):
    """Lightning's step hooks with stage 3's root unit gathered, and rank 0's buffers broadcast (Note [buffers follow
    rank 0])."""

    _buffer_broadcast: BufferBroadcast
    """Whether the next forward of ``fit`` starts with rank 0's buffers, as DDP's next forward would."""

    def _with_root_gathered(self, step: Callable[[], Any]) -> Any:
        if self._gatherer is None:
            return step()
        root = self._gatherer.units[0]
        with self._gatherer.calls.step() if self._gatherer.calls is not None else nullcontext():
            self._gatherer.pre_forward(root)  # every rank runs the step: Note [one-rank calls]
            output = None
            try:
                output = step()
                return output
            finally:
                self._gatherer.post_forward(root, output)  # hooks the loss for the root's pre-backward gather

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._forward_of_the_fit()
        return self._with_root_gathered(lambda: super(RootUnitSteps, self).training_step(*args, **kwargs))

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._forward_of_the_fit()
        return self._with_root_gathered(lambda: super(RootUnitSteps, self).validation_step(*args, **kwargs))

    def _forward_of_the_fit(self) -> None:
        """Broadcast rank 0's buffers where DDP would, before a step of ``fit`` (Note [buffers follow rank 0])."""
        assert self.lightning_module is not None
        if self.lightning_module.trainer.state.fn != TrainerFn.FITTING:
            return
        self._buffer_broadcast.before_forward(self.lightning_module, self.process_group, self.config.broadcast_buffers)

    def _broadcast_buffers(self) -> None:
        assert self.lightning_module is not None
        broadcast_buffers(self.lightning_module, self.process_group)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._with_root_gathered(lambda: super(RootUnitSteps, self).test_step(*args, **kwargs))

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._with_root_gathered(lambda: super(RootUnitSteps, self).predict_step(*args, **kwargs))
