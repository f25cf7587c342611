"""``ZeroFabricPrecision``: ``ZeroPrecision`` (``lightning/precision.py``) under Fabric's protocol.

The parameters' dtypes, the masters, autocast, the normalization layers and the loss scalers are
``ZeroPrecision``'s, unchanged; only the calls differ. Fabric's ``Strategy.backward`` ignores what ``pre_backward``
returns and back-propagates from ``backward``'s argument, so the loss is scaled there (as Fabric's ``MixedPrecision``
does); there are no Trainer hooks to call around it; and ``optimizer_step`` takes the optimizer alone.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor
from torch.nn import Module
from typing_extensions import override

from lightning_zero.lightning.precision import ZeroPrecision
from lightning_zero.sharding.loss_scaler import scale_for_backward


class ZeroFabricPrecision(ZeroPrecision):
    """ZeRO's precision plugin for ``Fabric(strategy="zero*", precision=...)``: see ``ZeroPrecision``."""

    @override
    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:
        return tensor

    @override
    def backward(self, tensor: Tensor, model: Module | None, *args: Any, **kwargs: Any) -> None:
        if self.loss_scalers:
            tensor = tensor * scale_for_backward(self.loss_scalers)  # Note [one loss scale per optimizer]
        tensor.backward(*args, **kwargs)

    @override
    def post_backward(self, tensor: Tensor, module: Any) -> Tensor:
        if self.after_backward is not None:
            self.after_backward()  # Note [no partial gradients] in lightning/grad_norm.py
        return tensor

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return optimizer.step(**kwargs)
