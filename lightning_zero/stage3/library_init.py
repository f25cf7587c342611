"""How modules of other libraries initialize themselves, re-created for a model built on the meta device.

``shard_module`` initializes a module built on meta by its ``reset_parameters()``: what torch's layers do in their
constructors. Libraries that build models out of those layers initialize them again afterwards, in code that never
runs on meta; this module finds the modules concerned and gives each the initializer its library would have run, or
refuses, naming the module, when that initialization cannot be re-created. The packages are found in
``sys.modules``: none is imported here, and a model of a package nobody imported cannot exist.

Note [Hugging Face initialization]
A ``transformers`` model initializes itself in two passes: each layer's constructor (torch's defaults), then the
model's ``_init_weights`` applied to every module children-first (``post_init``), which also covers its own layers
that have no ``reset_parameters()`` (RMSNorms, rotary embeddings' ``inv_freq``). Built on meta, both are lost. So a
module inside a ``PreTrainedModel`` (the innermost one around it) is initialized as that model would:
``reset_parameters()`` if it has one, then the model's ``_init_weights``, when the walk leaves its subtree, so that a
parent's ``_init_weights`` (T5's scales the shared embedding) runs after its children's as in ``post_init``. The
weights follow the model's own initialization, not bit for bit (each unit's random draws happen before the next
unit's constructors'). A module of another library inside (a user's block) ends the model's reach: its subtree is
initialized by ``reset_parameters()``. ``param_init_fn`` replaces all of this.

Note [torch's composite modules]
Two of torch's own modules initialize more than their ``reset_parameters()`` covers. ``nn.MultiheadAttention``'s
constructor runs ``_reset_parameters()`` (it has no public one), which also zeroes its child ``out_proj``'s bias: it
runs when the walk leaves the attention (a leaf unit, so ``out_proj`` is still whole). ``nn.Transformer``'s
constructor ends with Xavier-uniform on every matrix under it (encoder and decoder layers alike); its layers are
usually units of their own, sharded before the walk leaves the transformer, so each module under it gets that
Xavier draw on its own matrices right after its own initialization: the same distribution, one module at a time.

Note [peft adapters on meta]
``get_peft_model`` wraps a target layer in a LoRA layer that keeps the original as ``base_layer`` and adds adapter
layers (``lora_A``, ``lora_B``), initialized in the LoRA layer's constructor: ``lora_B`` to zeros, so that the
adapted model starts as the base model. On meta that is lost, and ``lora_B``'s own ``reset_parameters()`` would make
the adapter a random perturbation of every targeted layer, silently. So the base layer stays in the Hugging Face
model's reach (it is the model's layer, initialized by ``_init_weights`` before peft existed), and the adapter layers
are initialized when the walk leaves the LoRA layer: their ``reset_parameters()``, then peft's
``reset_lora_parameters`` with the adapter's ``init_lora_weights`` from the ``LoraConfig`` of the peft model around
it. Initializations computed from the base layer's pretrained weights (PiSSA, OLoRA, LoftQ, EVA, ..., and DoRA's
magnitude) have no values to start from on meta, and any other module of peft built on meta (prompt tuning's
virtual tokens, ``modules_to_save`` copies) is initialized by code we cannot re-run: those are refused up front,
before any collective, with the fix. (Even prompt tuning's ``RANDOM`` init, its embedding's own, cannot run: the peft
model keeps its virtual token ids in a plain tensor, ``prompt_tokens``, which stays on meta.)
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from torch import nn

from lightning_zero.compat import DeviceContext, device_constructors

ParamInitFn = Callable[[nn.Module], None]

_PEFT_HINT = (
    "HINT: build the model and apply the adapters in `__init__` (outside `configure_model` and "
    "`trainer.init_module(empty_init=True)`), or pass `param_init_fn` "
    "to ZeroStrategy to initialize every module yourself."
)
# How peft re-initializes a LoRA adapter in ``reset_lora_parameters``; the rest need the base layer's weights.
_LORA_INITS: tuple[bool | str, ...] = (True, False, "gaussian")


@dataclass
class LibraryInits:
    """What a model's libraries initialize, by ``id`` of module (Notes [Hugging Face initialization], [torch's
    composite modules] and [peft adapters on meta])."""

    hugging_face: dict[int, nn.Module] = field(default_factory=dict)
    """Module -> the innermost ``PreTrainedModel`` around it, whose ``_init_weights`` it gets."""
    adapters: dict[int, nn.Module] = field(default_factory=dict)
    """Module of a LoRA layer's adapters (``lora_A``, ``lora_B``, their dropout, ...) -> that LoRA layer."""
    lora: dict[int, list[tuple[str, bool | str]]] = field(default_factory=dict)
    """LoRA layer -> ``(adapter name, init_lora_weights)`` for each adapter it holds."""
    attention: set[int] = field(default_factory=set)
    """``nn.MultiheadAttention`` modules outside a Hugging Face model: ``_reset_parameters()`` after their children."""
    xavier: set[int] = field(default_factory=set)
    """Modules under an ``nn.Transformer``: Xavier-uniform on their own matrices after their own initialization."""

    def deferred(self, module: nn.Module) -> bool:
        """Whether ``module``'s own initialization waits for the walk to leave a subtree (its own or a LoRA
        layer's)."""
        return any(id(module) in kind for kind in (self.hugging_face, self.adapters, self.attention))

    def initialized_after_children(self, module: nn.Module) -> bool:
        """Whether ``module``'s initializer runs when the walk leaves its subtree (post-order)."""
        return any(id(module) in kind for kind in (self.hugging_face, self.lora, self.attention))

    def finishing(self, module: nn.Module, init: Callable[[], None]) -> Callable[[], None]:
        """``init`` followed by what an ``nn.Transformer`` around ``module`` does to it (Note [torch's composite
        modules])."""
        if id(module) not in self.xavier:
            return init

        def then_xavier() -> None:
            init()
            for p in module.parameters(recurse=False):
                if p.dim() > 1:
                    nn.init.xavier_uniform_(p)

        return then_xavier


def constructor_init(module: nn.Module) -> Callable[[], None] | None:
    """What ``module``'s constructor runs to initialize its own parameters and buffers: ``reset_parameters()``, or
    ``nn.MultiheadAttention``'s private ``_reset_parameters()``; None if it has neither."""
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        return reset  # type: ignore[no-any-return]
    if isinstance(module, nn.MultiheadAttention):
        return module._reset_parameters
    return None


def _library(module: nn.Module) -> str:
    return type(module).__module__.split(".")[0]


def owns_meta_tensors(module: nn.Module) -> bool:
    """Whether ``module`` has parameters or buffers of its own still on the meta device."""
    return any(t.is_meta for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)])


def _is_lora_layer(module: nn.Module) -> bool:
    """A peft LoRA layer whose adapters peft initializes with ``LoraLayer.reset_lora_parameters`` (AdaLoRA's layers
    override it with another signature: they are left to the generic refusal)."""
    lora = getattr(sys.modules.get("peft.tuners.lora.layer"), "LoraLayer", None)
    if lora is None or not isinstance(module, lora):
        return False
    return getattr(type(module), "reset_lora_parameters", None) is getattr(lora, "reset_lora_parameters", None)


def _lora_adapters(layer: Any, configs: dict[str, Any] | None, name: str) -> list[tuple[str, bool | str]]:
    """Each adapter of ``layer`` with its ``init_lora_weights``; raises if peft's initialization of it cannot be
    re-created on meta (Note [peft adapters on meta])."""
    where = f"{type(layer).__name__} {name!r}"
    if getattr(layer, "lora_variant", None):
        variants = ", ".join(f"{k}: {type(v).__name__}" for k, v in layer.lora_variant.items())
        raise ValueError(
            f"The LoRA layer {where} was built on the meta device with a LoRA variant ({variants}, e.g. "
            "use_dora=True), whose initial weights peft computes from the base layer's weights; on meta there are "
            f"none, and stage 3 cannot re-create them. {_PEFT_HINT}"
        )
    adapters = [*layer.lora_A.keys(), *getattr(layer, "lora_embedding_A", {}).keys()]
    result: list[tuple[str, bool | str]] = []
    for adapter in adapters:
        config = (configs or {}).get(adapter)
        how = getattr(config, "init_lora_weights", None)
        if config is None or how is None:
            raise ValueError(
                f"The LoRA layer {where} was built on the meta device, and no peft model around it has a LoraConfig "
                f"for its adapter {adapter!r} (its `peft_config`), so stage 3 cannot tell how peft initialized it "
                f"(lora_B starts at zero by default). {_PEFT_HINT}"
            )
        if not any(how is known or (isinstance(how, str) and how == known) for known in _LORA_INITS):
            raise ValueError(
                f"The LoRA layer {where} was built on the meta device with init_lora_weights={how!r} for adapter "
                f"{adapter!r}, which peft computes from the base layer's pretrained weights; on meta there are none. "
                f"Stage 3 re-creates init_lora_weights True, False and 'gaussian' only. {_PEFT_HINT}"
            )
        result.append((adapter, how))
    return result


def _warn_if_initializer_unused(module: nn.Module, warned: set[type]) -> None:
    """Warn, once per class, about a module of user code with an initializer of its own that stage 3 will not call
    (``init_weights()``, as in torch's word-language-model example and torchtitan; ``_init_weights()``): if its
    ``__init__`` runs it, what it sets is lost on meta. A module with ``reset_parameters()`` is initialized by it."""
    kind = type(module)
    if kind in warned or constructor_init(module) is not None:
        return
    method = next((m for m in ("init_weights", "_init_weights") if callable(getattr(module, m, None))), None)
    if method is None or not any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
        return
    warned.add(kind)
    warnings.warn(
        f"{kind.__name__} defines {method}() but no reset_parameters(); built on the meta device, stage 3 initializes "
        f"its layers with their own reset_parameters() and never calls {method}(), so if {kind.__name__}.__init__ "
        f"runs it, that initialization is lost. HINT: pass `param_init_fn` to ZeroStrategy (called with every "
        "module that owns parameters) to re-create it, or build the model in `__init__` (outside `configure_model` "
        "and `trainer.init_module(empty_init=True)`).",
        UserWarning,
        stacklevel=4,
    )


def library_inits(root: nn.Module) -> LibraryInits:
    """Find the modules of ``root`` that their library initializes (see the notes above); raise, before anything is
    allocated, for a module built on meta whose library's initialization cannot be re-created."""
    # Not ``sys.modules["transformers"].PreTrainedModel``: the package is lazy, and that attribute would import its
    # whole modeling stack (seconds) in every process that shards any model. An instance exists only once
    # ``transformers.modeling_utils``, which defines the class, has been imported.
    pretrained = getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)
    found = LibraryInits()
    names = {id(m): n for n, m in root.named_modules()}
    seen: set[int] = set()  # a module reachable twice is initialized where the walk meets it first
    warned: set[type] = set()

    def adapters_of(layer: nn.Module, module: nn.Module) -> None:
        for m in module.modules():
            if id(m) not in seen:
                seen.add(id(m))
                found.adapters[id(m)] = layer

    def visit(
        module: nn.Module, owner: nn.Module | None, peft: nn.Module | None, configs: Any, in_transformer: bool
    ) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        library = _library(module)
        if isinstance(module, nn.Transformer):
            in_transformer = True
        if pretrained is not None and isinstance(module, pretrained):
            owner, peft = module, None
        elif library == "peft":
            configs = getattr(module, "peft_config", configs)
            if _is_lora_layer(module):
                if any(owns_meta_tensors(m) for m in module.modules()):
                    found.lora[id(module)] = _lora_adapters(module, configs, names.get(id(module), ""))
                for child in module.children():
                    if child is getattr(module, "base_layer", None):
                        visit(child, owner, None, configs, in_transformer)  # the model's, not peft's
                    else:
                        adapters_of(module, child)
                return
            owner, peft = None, module
        elif library not in ("transformers", "torch"):
            owner, peft = None, None  # user code: its modules' reset_parameters()
            _warn_if_initializer_unused(module, warned)
        if in_transformer:
            found.xavier.add(id(module))
        if owner is not None:
            found.hugging_face[id(module)] = owner
        elif isinstance(module, nn.MultiheadAttention):
            found.attention.add(id(module))
        if owner is None and peft is not None and owns_meta_tensors(module):
            raise ValueError(
                f"{type(module).__name__} {names.get(id(module), '')!r}, inside peft's {type(peft).__name__}, was "
                "built on the meta device; peft may set its values in its own code (prompt tuning's virtual tokens "
                "from the vocabulary, modules_to_save copies of the model's layers, adapters other than LoRA), which "
                "stage 3 cannot re-run, and its reset_parameters() could start training elsewhere without any error. "
                f"Stage 3 re-creates peft's LoRA adapters only. {_PEFT_HINT}"
            )
        for child in module.children():
            visit(child, owner, peft, configs, in_transformer)

    visit(root, None, None, None, False)
    return found


def hugging_face_init(owner: nn.Module, constructed: bool) -> ParamInitFn:
    """The initialization ``owner`` (a ``PreTrainedModel``) gives a module of its own: ``constructed``, the module
    has parameters or buffers of its own to create, as its constructor did."""

    def init(module: nn.Module) -> None:
        reset = constructor_init(module)
        if constructed and reset is not None:  # what the constructor did before the model's own initialization
            reset()
        init_weights: ParamInitFn = getattr(owner, "_init_weights")  # noqa: B009  (not a Tensor: nn.Module's typing)
        try:
            init_weights(module)
        except RuntimeError as error:  # most likely it wrote to a placeholder: a unit inside it is sharded already
            raise RuntimeError(
                f"The Hugging Face initialization (_init_weights) of {type(module).__name__} failed, most likely "
                f"writing parameters of a stage-3 unit inside it that is sharded already: {error} HINT: make units "
                "no smaller than the modules whose _init_weights sets their children's parameters (the default "
                "policy wraps the decoder layers; `wrap_module_classes` names them), or pass `param_init_fn`."
            ) from error

    return init


def lora_init(layer: nn.Module, adapters: list[tuple[str, bool | str]], members: list[nn.Module]) -> Callable[[], None]:
    """What the LoRA layer's constructor did to ``members`` (its adapter modules built on meta): their
    ``reset_parameters()``, then peft's ``reset_lora_parameters`` per adapter (Note [peft adapters on meta])."""

    def init() -> None:
        for module in members:
            reset = constructor_init(module)
            if reset is not None:
                reset()
            elif isinstance(module, nn.ParameterDict):  # an embedding's adapters: peft draws them with torch.randn
                for p in module.parameters(recurse=False):
                    nn.init.normal_(p)
        for adapter, how in adapters:
            if how:  # False keeps torch's defaults, as peft does
                try:
                    layer.reset_lora_parameters(adapter, how)  # type: ignore[operator]
                except RuntimeError as error:
                    raise RuntimeError(
                        f"peft's initialization of LoRA adapter {adapter!r} in {type(layer).__name__} failed, most "
                        f"likely writing a stage-3 unit inside it that is sharded already: {error} HINT: make units "
                        "no smaller than the layers peft wraps (`wrap_module_classes`), or pass `param_init_fn`."
                    ) from error

    return init


@contextmanager
def pretrained_on_meta_hint(where: str) -> Iterator[None]:
    """Around a build on meta: ``transformers`` refuses ``from_pretrained`` under a meta device context (the weights
    would be lost); add how to load pretrained weights into a stage-3 model instead. ``where``: what built on meta."""
    try:
        yield
    except RuntimeError as error:
        if "from_pretrained" not in str(error) or "meta" not in str(error):
            raise
        raise RuntimeError(
            f"{error}\nAt stage 3 {where} builds the model on the meta device, so its weights can only come "
            "afterwards. HINT: build it from its config (`AutoModelForCausalLM.from_config(AutoConfig.from_pretrained("
            "path))`) and load the weights into the shards with `trainer.fit(model, ckpt_path=path)` or "
            "`lightning_zero.load_full_state_dict` (docs/fine-tuning.md); or call `from_pretrained` in "
            "`__init__`, which builds the whole model on every rank first."
        ) from error


_METRIC_FRAMES = 12
"""How far up the stack a tensor's creation is looked for inside a metric's constructor (``add_state`` and helpers)."""


class MetaDeviceExceptMetrics(DeviceContext):
    """``torch.device("meta")`` for a stage-3 build, except for what a ``torchmetrics.Metric`` creates in its
    constructor.

    Note [metrics stay off meta]
    A metric's states are neither parameters nor buffers, so sharding, which materializes those unit by unit, never
    sees them, and on meta their defaults (a zero count, ``inf`` for a running minimum) are lost, with ``reset()``
    copying them from defaults that are meta too: a ``torchmetrics`` metric created in ``configure_model`` stayed on
    meta. Lightning's FSDP strategy builds ``configure_model`` on the device, where metrics simply work, so here the
    tensors a metric's constructor creates are built as without the context (a few scalars), and sharding moves them
    to the device with the rest of what is not on meta (Note [partly meta models] in ``sharded_init.py``). A tensor
    is the metric's when a frame of its creation, at most ``_METRIC_FRAMES`` up, is a ``Metric.__init__``; only
    while building on meta, once per tensor created.
    """

    def __init__(self) -> None:
        super().__init__("meta")

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func in device_constructors() and kwargs.get("device") is None and not _in_metric_constructor():
            kwargs["device"] = self.device
        return func(*args, **kwargs)


def _in_metric_constructor() -> bool:
    metric = getattr(sys.modules.get("torchmetrics"), "Metric", None)  # no torchmetrics imported: no metric
    if metric is None:
        return False
    frame: FrameType | None = sys._getframe(2)
    for _ in range(_METRIC_FRAMES):
        if frame is None:
            return False
        if frame.f_code.co_name == "__init__" and isinstance(frame.f_locals.get("self"), metric):
            return True
        frame = frame.f_back
    return False
