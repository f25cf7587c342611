"""``ZeroFabricPrecision``: ZeRO's precision (``ParameterPrecision``, ``engine/precision.py``) under Fabric's protocol.

The parameters' dtypes, the masters, autocast, the normalization layers and the loss scalers are
``ParameterPrecision``'s, as the Trainer's ``ZeroPrecision`` has them; only the calls differ. Fabric's
``Strategy.backward`` ignores what ``pre_backward`` returns and back-propagates from ``backward``'s argument, so the
loss is scaled there (as Fabric's ``MixedPrecision`` does); there are no Trainer hooks to call around it; and
``optimizer_step`` takes the optimizer alone.

What the model's forward sees and returns is what Fabric's own plugins give it (``MixedPrecision``,
``HalfPrecision``), so that a Fabric loop computes what it computes under Fabric's DDP: floating inputs in the
low-precision dtype, outputs back in the default dtype (the loss outside the model is fp32), and under ``-true``
tensors created inside the forward in the low-precision dtype.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
from lightning_utilities import apply_to_collection
from torch import Tensor
from torch.nn import Module
from typing_extensions import override

from lightning_zero.compat import DtypeContextManager, convert_fp_tensor
from lightning_zero.engine.precision import ParameterPrecision
from lightning_zero.sharding.loss_scaler import scale_for_backward


class ZeroFabricPrecision(ParameterPrecision):
    """ZeRO's precision plugin for ``Fabric(strategy="zero*", precision=...)``: see ``ParameterPrecision``."""

    _strategy_name = "ZeroFabricStrategy"
    _front_door = "Fabric"

    @override
    def convert_input(self, data: Any) -> Any:
        return self._converted(data, self.param_dtype)

    @override
    def convert_output(self, data: Any) -> Any:
        # Low-precision outputs (a bf16 model's logits) come back in the default dtype, as Fabric's plugins return
        # them, so that a loss computed outside the model is computed in fp32, as under Fabric's DDP.
        return self._converted(data, torch.get_default_dtype())

    @contextmanager
    @override
    def forward_context(self) -> Generator[None, None, None]:
        inner = super().forward_context() if self._mixed else DtypeContextManager(self.param_dtype)  # as Fabric's
        with inner:
            yield

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
            self.after_backward()  # Note [no partial gradients] in engine/grad_norm.py
        return tensor

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return optimizer.step(**kwargs)

    def _converted(self, data: Any, dtype: torch.dtype) -> Any:
        """Floating tensors of ``data`` in ``dtype``; untouched in 32-true, as Fabric's ``Precision`` leaves them."""
        if self.param_dtype == torch.float32 and torch.get_default_dtype() == torch.float32:
            return data
        return apply_to_collection(data, function=convert_fp_tensor, dtype=Tensor, dst_type=dtype)
