"""``ParameterPrecision``: ZeRO's precision, what the precision plugins of both front doors install in place of
Lightning's (the Trainer's ``ZeroPrecision``, Fabric's ``ZeroFabricPrecision``), and the mapping of Lightning's
plugins onto them (``to_zero_precision``).

ZeRO's mixed precision is not autocast over fp32 weights: the *parameters* (and so gradients and their communication)
are bf16 or fp16, and the sharded optimizer keeps fp32 master weights and fp32 optimizer state for its shard. That
is what gives the paper's 4Ψ + 12Ψ/N (stage 1), 2Ψ + 14Ψ/N (stage 2) and 16Ψ/N (stage 3) bytes per rank.

| ``precision``  | parameters, gradients | master weights, optimizer state | forward         | loss scaling |
|----------------|-----------------------|---------------------------------|-----------------|--------------|
| ``32-true``    | fp32                  | fp32 (the parameters themselves) | as written      | -            |
| ``bf16-mixed`` | bf16                  | fp32                            | bf16 autocast   | -            |
| ``16-mixed``   | fp16                  | fp32                            | fp16 autocast   | dynamic      |
| ``bf16-true``  | bf16                  | bf16 (no fp32 copy)             | inputs to bf16  | -            |

Note [mixed precision runs any model]
Under Lightning's own ``"bf16-mixed"``/``"16-mixed"`` (what DDP runs) everything is fp32 and autocast lowers the
matmuls; here the parameters themselves are low precision, which must not change what a model can do:

- Floating *buffers* stay fp32, as under Lightning's plugin: only parameters are cast (``convert_module``, and at
  birth inside ``configure_model``/``init_module``: ``_low_precision_parameters``). A positional encoding, a
  BatchNorm running statistic or a float step counter keeps its fp32 values and updates.
- The forward runs under autocast, as Lightning's plugin does, so matmuls and convolutions take fp32 inputs.
- Normalization layers are the ops autocast does not reconcile: ``layer_norm`` with an fp32 input (a model input,
  or an fp32 buffer added to bf16 activations) and bf16 weights fails on CPU (``mixed dtype (CPU): expect parameter
  to have scalar type of Float``), and ``batch_norm`` with fp32 running statistics needs fp32 weights on every
  device. Inside the forward, ``_NormsSeeFullPrecisionAffine`` hands the F.*_norm functions their (1-D, cheap)
  weight and bias in the dtype DDP's would have: the input's or the running statistics', whichever is wider. The
  result is the op DDP computes, on bf16-rounded weights, and gradients flow back to the bf16 parameters through
  the cast. Limits: an fp32 tensor reaching a norm in a region recomputed under activation checkpointing (the
  recomputation runs outside the forward context), and norms written as raw ops (``x * rsqrt(var) * weight``,
  which promote and need nothing).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Generator, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Literal, TypeVar

import torch
from lightning.fabric.plugins.precision import HalfPrecision as FabricHalfPrecision
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning_utilities import apply_to_collection
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.parameter import UninitializedParameter
from torch.overrides import TorchFunctionMode
from typing_extensions import override

from lightning_zero.compat import DtypeContextManager, convert_fp_tensor
from lightning_zero.sharding.loss_scaler import DynamicLossScaler, scale_for_backward

ZeroPrecisionName = Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true"]
SUPPORTED: tuple[ZeroPrecisionName, ...] = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")

_PARAM_DTYPE: dict[str, torch.dtype] = {
    "32-true": torch.float32,
    "bf16-mixed": torch.bfloat16,
    "16-mixed": torch.float16,
    "bf16-true": torch.bfloat16,
}


class ParameterPrecision(Precision):
    """Parameters in ``param_dtype``; fp32 masters unless ``-true``; dynamic loss scaling for ``16-mixed``. What
    both front doors' plugins share: the Trainer's ``ZeroPrecision`` adds its clipping hooks, Fabric's
    ``ZeroFabricPrecision`` its backward and step protocol."""

    _strategy_name = "ZeroStrategy"
    _front_door = "Trainer"
    """The strategy and front door this plugin serves, as errors name them (Fabric's plugin names its own)."""

    def __init__(self, precision: ZeroPrecisionName = "32-true", loss_scaler: DynamicLossScaler | None = None) -> None:
        if precision not in SUPPORTED:
            raise ValueError(
                f"Invalid precision for {self._strategy_name}: {precision!r}. Expected one of {', '.join(SUPPORTED)}. "
                "HINT: '16-true' (fp16 without loss scaling or master weights) diverges; use '16-mixed' or "
                "'bf16-true' instead."
            )
        if loss_scaler is not None and precision != "16-mixed":
            raise ValueError(
                f"A loss scaler is only used with precision='16-mixed', not {precision!r}. HINT: drop `loss_scaler` "
                "(bf16 and fp32 gradients do not underflow), or use "
                f"{type(self).__name__}('16-mixed', loss_scaler=...)."
            )
        self.precision = precision
        self.param_dtype = _PARAM_DTYPE[precision]
        self.fp32_masters = precision != "bf16-true"
        self.loss_scaler = loss_scaler or (DynamicLossScaler() if precision == "16-mixed" else None)
        """The first optimizer's scaler; each other optimizer gets its own with the same schedule (Note [one loss
        scale per optimizer] in ``sharding/loss_scaler.py``)."""
        self.loss_scalers: list[DynamicLossScaler] = [self.loss_scaler] if self.loss_scaler is not None else []
        self._configured_scaler = copy.copy(self.loss_scaler)
        self.after_backward: Callable[[], None] | None = None
        """Set by the strategy: runs after each backward, before the Trainer's ``on_after_backward`` (Note [no
        partial gradients] in ``grad_norm.py``)."""

    # -- model: Note [mixed precision runs any model] ---------------------------------------------------------------
    @property
    def _mixed(self) -> bool:
        return self.precision.endswith("-mixed")

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        if self.param_dtype == torch.float32:
            return module
        if not self._mixed:
            return module.to(self.param_dtype)  # bf16-true: buffers too, as Lightning's HalfPrecision
        with torch.no_grad():
            for param in module.parameters():
                if param.is_floating_point() and param.dtype != self.param_dtype:
                    param.data = param.data.to(self.param_dtype)
        return module

    @override
    def tensor_init_context(self) -> AbstractContextManager[Any]:
        # Parameters are created directly in their dtype: a bf16 model never exists in fp32, not even transiently.
        if self.param_dtype == torch.float32:
            return nullcontext()
        return _low_precision_parameters(self.param_dtype) if self._mixed else DtypeContextManager(self.param_dtype)

    @override
    def module_init_context(self) -> AbstractContextManager[Any]:
        return self.tensor_init_context()

    @contextmanager
    @override
    def forward_context(self) -> Generator[None, None, None]:
        if self._mixed:
            # Autocast casts fp32 inputs for matmuls and keeps softmax, norms and losses in fp32.
            device_type = "cuda" if torch.cuda.is_available() and torch.cuda.is_initialized() else "cpu"
            with torch.autocast(device_type, dtype=self.param_dtype), _NormsSeeFullPrecisionAffine():
                yield
        else:
            yield

    def loss_scalers_for(self, count: int) -> list[DynamicLossScaler | None]:
        """One loss scaler per optimizer (``16-mixed``), the first being ``loss_scaler``; None for the others."""
        if self.loss_scaler is None or self._configured_scaler is None:
            return [None] * count
        extra = [copy.copy(self._configured_scaler) for _ in range(count - 1)]
        self.loss_scalers = [self.loss_scaler, *extra]
        return list(self.loss_scalers)

    @override
    def convert_input(self, data: Any) -> Any:
        if self.precision == "bf16-true":
            return apply_to_collection(data, function=convert_fp_tensor, dtype=Tensor, dst_type=self.param_dtype)
        return data

    # -- backward and step ----------------------------------------------------------------------------------------
    @override
    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:
        if self.loss_scalers:
            tensor = tensor * scale_for_backward(self.loss_scalers)  # Note [one loss scale per optimizer]
        return super().pre_backward(tensor, module)

    @override
    def post_backward(self, tensor: Tensor, module: Any) -> Tensor:
        if self.after_backward is not None:
            self.after_backward()  # before `on_after_backward`, which super() calls
        return super().post_backward(tensor, module)

    @override
    def state_dict(self) -> dict[str, Any]:
        if self.loss_scaler is None:
            return {}
        state: dict[str, Any] = {"loss_scaler": self.loss_scaler.state_dict()}
        if len(self.loss_scalers) > 1:
            state["loss_scalers"] = [scaler.state_dict() for scaler in self.loss_scalers]
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.loss_scaler is None:
            return
        saved = state_dict.get("loss_scalers")
        if saved is not None and len(saved) == len(self.loss_scalers):
            for scaler, state in zip(self.loss_scalers, saved, strict=True):
                scaler.load_state_dict(state)
        elif "loss_scaler" in state_dict:
            self.loss_scaler.load_state_dict(state_dict["loss_scaler"])


# (weight, bias) positions of each F.*_norm function, and of its running statistics (never cast: updated in place).
_AFFINE: dict[Callable[..., Any], tuple[int, ...]] = {
    F.layer_norm: (2, 3),
    F.group_norm: (2, 3),
    F.batch_norm: (3, 4),
    F.instance_norm: (3, 4),
    F.rms_norm: (2,),
}
_STATISTICS: dict[Callable[..., Any], tuple[int, ...]] = {F.batch_norm: (1, 2), F.instance_norm: (1, 2)}


class _NormsSeeFullPrecisionAffine(TorchFunctionMode):
    """Normalization functions get weight and bias in the dtype of their input or running statistics, whichever is
    wider, when the parameters are narrower (Note [mixed precision runs any model])."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        positions = _AFFINE.get(func)
        if positions is not None and args and isinstance(args[0], Tensor) and args[0].is_floating_point():
            args, kwargs = _widen_affine(func, positions, list(args), kwargs)
        return func(*args, **kwargs)


def _widen_affine(
    func: Callable[..., Any], positions: tuple[int, ...], args: list[Any], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    wide = args[0].dtype
    names = ("running_mean", "running_var")
    for position, name in zip(_STATISTICS.get(func, ()), names, strict=False):
        stat = args[position] if position < len(args) else kwargs.get(name)
        if isinstance(stat, Tensor) and stat.is_floating_point():
            wide = torch.promote_types(wide, stat.dtype)

    def widen(value: Any) -> Any:
        narrower = isinstance(value, Tensor) and value.is_floating_point() and value.dtype != wide
        return value.to(wide) if narrower and torch.promote_types(value.dtype, wide) == wide else value

    for position, name in zip(positions, ("weight", "bias"), strict=False):
        if position < len(args):
            args[position] = widen(args[position])
        elif name in kwargs:
            kwargs[name] = widen(kwargs[name])
    return tuple(args), kwargs


@contextmanager
def _low_precision_parameters(dtype: torch.dtype) -> Iterator[None]:
    """Every floating parameter registered inside is cast to ``dtype`` as it is registered (so the model never
    exists in fp32), while buffers and other tensors keep the default dtype (Note [mixed precision runs any
    model])."""

    def cast(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
        if type(param) is not nn.Parameter or isinstance(param, UninitializedParameter):
            return None  # None, lazy or a custom Parameter subclass: convert_module casts it later
        if not param.is_floating_point() or param.dtype == dtype:
            return None
        return nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad)

    handle = nn.modules.module.register_module_parameter_registration_hook(cast)  # type: ignore[arg-type]
    try:
        yield
    finally:
        handle.remove()


P = TypeVar("P", bound=ParameterPrecision)

_PLAIN: tuple[type[FabricPrecision], ...] = (Precision, FabricPrecision)
_TRANSLATED: tuple[type[FabricPrecision], ...] = (
    MixedPrecision,
    HalfPrecision,
    FabricMixedPrecision,
    FabricHalfPrecision,
)


def to_zero_precision(plugin: FabricPrecision | None, zero_type: type[P]) -> P:
    """Translate the plugin Lightning built from ``Trainer(precision=...)`` (``zero_type``: the Trainer's
    ``ZeroPrecision``) or Fabric from ``Fabric(precision=...)`` (``ZeroFabricPrecision``) into ZeRO's own."""
    if plugin is None or isinstance(plugin, zero_type):
        return plugin or zero_type()
    front, strategy = zero_type._front_door, zero_type._strategy_name
    if isinstance(plugin, ParameterPrecision):
        raise ValueError(
            f"{type(plugin).__name__} is {plugin._strategy_name}'s ZeRO precision plugin; {strategy} needs a "
            f"{zero_type.__name__}. HINT: pass `precision=...` or `{zero_type.__name__}({plugin.precision!r})`."
        )
    if type(plugin) in _PLAIN:
        return zero_type("32-true")
    name = getattr(plugin, "precision", None)
    # Exact types only: a subclass customizes what the plugin does, which the translation would silently drop.
    if type(plugin) in _TRANSLATED and name in SUPPORTED:
        scaler = getattr(plugin, "scaler", None)
        if name != "16-mixed" or scaler is None or not scaler.is_enabled():  # disabled: e.g. a CUDA scaler on CPU
            return zero_type(name)
        # Keep the schedule of a GradScaler the user configured (Lightning's own default equals ours).
        loss_scaler = DynamicLossScaler(
            scale=scaler.get_scale(),
            growth_factor=scaler.get_growth_factor(),
            backoff_factor=scaler.get_backoff_factor(),
            growth_interval=scaler.get_growth_interval(),
        )
        return zero_type("16-mixed", loss_scaler=loss_scaler)
    if isinstance(plugin, _TRANSLATED) and type(plugin) not in _TRANSLATED:
        base = "MixedPrecision" if isinstance(plugin, (MixedPrecision, FabricMixedPrecision)) else "HalfPrecision"
        raise ValueError(
            f"{strategy} cannot use {type(plugin).__name__}, a customized {base}: "
            "ZeRO replaces the precision plugin with its own (bf16/fp16 parameters, fp32 master weights), which "
            f"would silently drop the customization. HINT: subclass lightning_zero.{zero_type.__name__}({name!r}) "
            "instead and pass it in `plugins`."
        )
    raise ValueError(
        f"{strategy} does not support the precision plugin {type(plugin).__name__}"
        f"{f' (precision={name!r})' if name else ''}. HINT: use {front}(precision=...) with one of "
        f"{', '.join(SUPPORTED)}, or pass lightning_zero.{zero_type.__name__}(...) in `plugins`."
    )
