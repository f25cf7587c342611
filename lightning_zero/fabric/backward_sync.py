"""``fabric.no_backward_sync``: gradient accumulation without communication, through the ``ZeroOptimizer``s'
reducers (their ``no_sync``), as DDP's ``no_sync`` does for Fabric's DDP strategy."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any

from torch.nn import Module
from typing_extensions import override

from lightning_zero.compat import FabricBackwardSyncControl
from lightning_zero.fabric.models import SetUpModel, SetUpModels


class ZeroBackwardSyncControl(FabricBackwardSyncControl):
    """``fabric.no_backward_sync(model)``: the model's reducers accumulate locally inside."""

    def __init__(self, models: SetUpModels) -> None:
        self._models = models
        """The strategy's set-up models (Note [several models in one Fabric] in ``models.py``)."""

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager[Any]:
        """Backward passes inside accumulate this rank's gradients without communication; the first backward
        outside reduces them all (as DDP's ``no_sync``)."""
        if not enabled:
            return nullcontext()
        model = self._models.of(module)
        if model is None:
            raise TypeError(
                f"`no_backward_sync` got a {type(module).__name__} that ZeroFabricStrategy did not set up. HINT: pass "
                "the model `fabric.setup` returned."
            )
        return self._accumulating(model)

    @contextmanager
    def _accumulating(self, model: SetUpModel) -> Generator[None, None, None]:
        """This model's reducers accumulate locally, as DDP's ``no_sync`` of this model's ``DistributedDataParallel``
        does: the backward passes of other models inside still communicate."""
        with ExitStack() as stack:
            for reducer in model.reducers():
                stack.enter_context(reducer.no_sync())
            stack.enter_context(model.buffers.no_sync())  # Note [buffers follow rank 0]
            yield
