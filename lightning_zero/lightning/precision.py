"""``ZeroPrecision``: the precision plugin ``ZeroStrategy`` installs in place of Lightning's.

ZeRO's mixed precision is not autocast over fp32 weights: the *parameters* (and so gradients and their communication)
are bf16 or fp16, and the sharded optimizer keeps fp32 master weights and fp32 optimizer state for its shard. That
is what gives the paper's 4Ψ + 12Ψ/N (stage 1), 2Ψ + 14Ψ/N (stage 2) and 16Ψ/N (stage 3) bytes per rank.

| ``precision``  | parameters, gradients | master weights, optimizer state | forward         | loss scaling |
|----------------|-----------------------|---------------------------------|-----------------|--------------|
| ``32-true``    | fp32                  | fp32 (the parameters themselves) | as written      | -            |
| ``bf16-mixed`` | bf16                  | fp32                            | bf16 autocast   | -            |
| ``16-mixed``   | fp16                  | fp32                            | fp16 autocast   | dynamic      |
| ``bf16-true``  | bf16                  | bf16 (no fp32 copy)             | inputs to bf16  | -            |

Note [reduced gradients live in the optimizer]
After backward, a parameter's ``.grad`` does not hold the averaged gradient: stage 1 has already reduce-scattered
its flat gradient buffers into the sharded optimizer (and zeroed them for the next accumulation), stages 2 and 3 keep
only this rank's shard and leave ``.grad`` empty. The reduced gradients are the ``ZeroOptimizer``'s master
gradients. So clipping must go through Lightning (``Trainer(gradient_clip_val=...)``, or ``self.clip_gradients(...)``
inside ``configure_gradient_clipping`` or a manual ``training_step``), which lands in ``ZeroOptimizer.clip_grad_*``
and clips by the global norm across shards; ``torch.nn.utils.clip_grad_norm_(self.parameters(), ...)`` finds no
gradients and clips nothing, and code that inspects ``p.grad`` (``lightning.pytorch.utilities.grad_norm``) sees none.
We cannot see such a call, so a ``configure_gradient_clipping`` that never clipped through Lightning during a fit is
named in a warning when the fit ends.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning_utilities import apply_to_collection
from torch import Tensor, nn
from typing_extensions import override

from lightning_zero.sharding.loss_scaler import DynamicLossScaler
from lightning_zero.sharding.sharded_optimizer import ZeroOptimizer

ZeroPrecisionName = Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true"]
SUPPORTED: tuple[ZeroPrecisionName, ...] = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")

_PARAM_DTYPE: dict[str, torch.dtype] = {
    "32-true": torch.float32,
    "bf16-mixed": torch.bfloat16,
    "16-mixed": torch.float16,
    "bf16-true": torch.bfloat16,
}


class ZeroPrecision(Precision):
    """Parameters in ``param_dtype``; fp32 masters unless ``-true``; dynamic loss scaling for ``16-mixed``."""

    def __init__(self, precision: ZeroPrecisionName = "32-true", loss_scaler: DynamicLossScaler | None = None) -> None:
        if precision not in SUPPORTED:
            raise ValueError(
                f"Invalid precision for ZeroStrategy: {precision!r}. Expected one of {', '.join(SUPPORTED)}. "
                "HINT: '16-true' (fp16 without loss scaling or master weights) diverges; use '16-mixed' or "
                "'bf16-true' instead."
            )
        if loss_scaler is not None and precision != "16-mixed":
            raise ValueError(
                f"A loss scaler is only used with precision='16-mixed', not {precision!r}. HINT: drop `loss_scaler` "
                "(bf16 and fp32 gradients do not underflow), or use ZeroPrecision('16-mixed', loss_scaler=...)."
            )
        self.precision = precision
        self.param_dtype = _PARAM_DTYPE[precision]
        self.fp32_masters = precision != "bf16-true"
        self.loss_scaler = loss_scaler or (DynamicLossScaler() if precision == "16-mixed" else None)
        # A user's `configure_gradient_clipping` during this fit: its class, calls, and calls that clipped through
        # Lightning. See Note [reduced gradients live in the optimizer].
        self._clipping_hook: tuple[str, int, int] | None = None
        self._clipped = False

    # -- model ----------------------------------------------------------------------------------------------------
    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        return module.to(self.param_dtype) if self.param_dtype != torch.float32 else module

    @override
    def tensor_init_context(self) -> AbstractContextManager[Any]:
        # Parameters are created directly in their dtype: a bf16 model never exists in fp32, not even transiently.
        return _DtypeContextManager(self.param_dtype) if self.param_dtype != torch.float32 else nullcontext()

    @override
    def module_init_context(self) -> AbstractContextManager[Any]:
        return self.tensor_init_context()

    @contextmanager
    @override
    def forward_context(self) -> Generator[None, None, None]:
        if self.precision.endswith("-mixed"):
            # Autocast casts fp32 inputs for matmuls and keeps softmax, norms and losses in fp32.
            device_type = "cuda" if torch.cuda.is_available() and torch.cuda.is_initialized() else "cpu"
            with torch.autocast(device_type, dtype=self.param_dtype):
                yield
        else:
            yield

    @override
    def convert_input(self, data: Any) -> Any:
        if self.precision == "bf16-true":
            return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=self.param_dtype)
        return data

    # -- backward and step ----------------------------------------------------------------------------------------
    @override
    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:
        if self.loss_scaler is not None:
            tensor = tensor * self.loss_scaler.scale
        return super().pre_backward(tensor, module)

    @override
    def clip_gradients(
        self,
        optimizer: Any,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        # Lightning reads 0 as "no clipping" (it was the Trainer's default) but also ignores a negative or NaN value
        # without a word; such a value is a mistake, and training unclipped would hide it.
        if not clip_val >= 0:
            algorithm = GradClipAlgorithmType(gradient_clip_algorithm).value
            raise ValueError(
                f"Invalid gradient clip value {clip_val!r} for clipping by {algorithm}. Expected a positive number "
                "(or 0, which disables clipping). HINT: fix `Trainer(gradient_clip_val=...)` or the value passed to "
                "`self.clip_gradients(...)`; None disables clipping too."
            )
        self._clipped = True
        super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    @override
    def _clip_gradients(
        self,
        model: pl.LightningModule | nn.Module,
        optimizer: Any,
        clip_val: int | float | None = None,
        gradient_clip_algorithm: GradClipAlgorithmType | None = None,
    ) -> None:
        self._clipped = False
        super()._clip_gradients(model, optimizer, clip_val, gradient_clip_algorithm)  # calls the user's hook
        # Lightning calls the hook in automatic optimization only.
        hooked = isinstance(model, pl.LightningModule) and model.automatic_optimization
        if hooked and is_overridden("configure_gradient_clipping", model):
            _, calls, clipped = self._clipping_hook or ("", 0, 0)
            self._clipping_hook = (type(model).__name__, calls + 1, clipped + self._clipped)

    @override
    def teardown(self) -> None:
        # Only after the fit: a hook that clips conditionally (say, after warm-up) skips some steps on purpose.
        if self._clipping_hook is not None and self._clipping_hook[2] == 0:
            name, calls, _ = self._clipping_hook
            rank_zero_warn(
                f"`{name}.configure_gradient_clipping` ran {calls} times and never clipped through Lightning. Under "
                "ZeroStrategy the parameters' `.grad` do not hold the reduced gradients (Note [reduced gradients "
                "live in the optimizer] in lightning_zero/lightning/precision.py), so clipping them directly, e.g. "
                "`torch.nn.utils.clip_grad_norm_(self.parameters(), ...)`, clipped nothing. HINT: call "
                "`self.clip_gradients(optimizer, gradient_clip_val=..., gradient_clip_algorithm=...)` in the hook."
            )
        self._clipping_hook = None
        super().teardown()

    @override
    def clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        _zero_optimizer(optimizer).clip_grad_norm_(clip_val)

    @override
    def clip_grad_by_value(self, optimizer: Any, clip_val: int | float) -> None:
        _zero_optimizer(optimizer).clip_grad_value_(clip_val)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"loss_scaler": self.loss_scaler.state_dict()} if self.loss_scaler is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.loss_scaler is not None and "loss_scaler" in state_dict:
            self.loss_scaler.load_state_dict(state_dict["loss_scaler"])


def _zero_optimizer(optimizer: Any) -> ZeroOptimizer:
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer in manual optimization
    if not isinstance(optimizer, ZeroOptimizer):
        raise TypeError(f"ZeroPrecision clips gradients of a ZeroOptimizer, got {type(optimizer).__name__}.")
    return optimizer


def to_zero_precision(plugin: Precision | None) -> ZeroPrecision:
    """Translate the plugin Lightning built from ``Trainer(precision=...)`` into ZeRO's own."""
    if plugin is None or isinstance(plugin, ZeroPrecision):
        return plugin or ZeroPrecision()
    if type(plugin) is Precision:
        return ZeroPrecision("32-true")
    name = getattr(plugin, "precision", None)
    # Exact types only: a subclass customizes what the plugin does, which the translation would silently drop.
    if type(plugin) in (MixedPrecision, HalfPrecision) and name in SUPPORTED:
        scaler = getattr(plugin, "scaler", None)
        if name != "16-mixed" or scaler is None or not scaler.is_enabled():  # disabled: e.g. a CUDA scaler on CPU
            return ZeroPrecision(name)
        # Keep the schedule of a GradScaler the user configured (Lightning's own default equals ours).
        loss_scaler = DynamicLossScaler(
            scale=scaler.get_scale(),
            growth_factor=scaler.get_growth_factor(),
            backoff_factor=scaler.get_backoff_factor(),
            growth_interval=scaler.get_growth_interval(),
        )
        return ZeroPrecision("16-mixed", loss_scaler=loss_scaler)
    if isinstance(plugin, (MixedPrecision, HalfPrecision)) and type(plugin) not in (MixedPrecision, HalfPrecision):
        base = "MixedPrecision" if isinstance(plugin, MixedPrecision) else "HalfPrecision"
        raise ValueError(
            f"ZeroStrategy cannot use {type(plugin).__name__}, a customized {base}: "
            "ZeRO replaces the precision plugin with its own (bf16/fp16 parameters, fp32 master weights), which "
            f"would silently drop the customization. HINT: subclass lightning_zero.ZeroPrecision({name!r}) "
            "instead and pass it in `plugins`."
        )
    raise ValueError(
        f"ZeroStrategy does not support the precision plugin {type(plugin).__name__}"
        f"{f' (precision={name!r})' if name else ''}. HINT: use Trainer(precision=...) with one of "
        f"{', '.join(SUPPORTED)}, or pass lightning_zero.ZeroPrecision(...) in `plugins`."
    )
