"""The set-up model as Fabric holds it: ``ZeroForwardModule``, the strategy's forward module; what ``fabric.save``
does with a stage-3 model's state dict passed as a plain entry (its DTensors made whole; placeholders refused).

Note [marked forward methods]
Fabric wraps what a strategy's ``setup_module`` returns (its "forward module") in a ``_FabricModule`` that runs
``forward`` under the precision plugin (input and output dtypes, autocast). When the forward module is the model
itself, a method other than ``forward`` called on the wrapper (``model.generate(...)``, a ``loss`` method) is the
model's own method, called bare: no precision context, and at stage 3 no gather of the root unit, whose parameters
the method may read directly (a tied output embedding), which are then placeholders. When the forward module is a
wrapper, as DDP's and FSDP's are, Fabric routes every method marked with ``mark_forward_method`` through
``_FabricModule.forward`` and the wrapper's call, and refuses an unmarked one that calls the model's layers. So
``setup_module`` returns ``ZeroForwardModule``, whose call is the model's call: a marked method runs as ``forward``
does, under the precision plugin, with the root module's hooks (stage 3's gather, the buffer broadcast) around
it, and an unmarked one is refused as under DDP. The strategy maps the wrapper back to the model wherever Fabric
hands it over (``no_backward_sync``, ``save``, ``load``, ``load_raw``).
"""

from __future__ import annotations

from typing import Any

from lightning_utilities import apply_to_collection
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_zero.compat import FabricStateful


class ZeroForwardModule(Module):
    """The forward module of a model set up by ``ZeroFabricStrategy``: calls the model (Note [marked forward
    methods])."""

    def __init__(self, module: Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def full_tensors(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with every DTensor in its plain entries made whole (collective: every rank calls ``fabric.save``):
    a stage-3 ``model.state_dict()`` saved as an entry (lit-llama's ``fabric.save(path, {"model":
    model.state_dict()})``), or returned by a stateful object's ``state_dict()`` (an EMA of the weights), writes the
    full weights, as under Fabric's DDP (Note [a stage-3 model's state dict] in ``checkpoint/module_state.py``)."""
    return {
        name: value
        if isinstance(value, Module | Optimizer)
        else apply_to_collection(
            value.state_dict() if isinstance(value, FabricStateful) else value, DTensor, lambda t: t.full_tensor()
        )
        for name, value in state.items()
    }


def refuse_released_parameters(state: dict[str, Any], module: Module) -> None:
    """Refuse a state whose plain entries hold stage-3 parameters outside a gather (the parameters themselves, e.g.
    ``model.state_dict(keep_vars=True)``; ``model.state_dict()`` gives their values): their values are placeholders
    (Note [placeholders] in ``sharding/flat_bucket.py``), and the file would hold NaN where the weights should be."""
    released = {p.untyped_storage().data_ptr() for p in module.parameters() if p.numel() > 1 and not any(p.stride())}
    released.discard(0)
    for name, value in state.items():
        if isinstance(value, Module | Optimizer):
            continue
        found: list[Tensor] = []
        apply_to_collection(value, Tensor, found.append)
        plain = [t for t in found if t.device.type != "meta" and not isinstance(t, DTensor)]  # DTensors: made whole
        if any(t.untyped_storage().data_ptr() in released for t in plain):
            raise ValueError(
                f"`fabric.save` state {name!r} holds parameters of the stage-3 model taken outside a forward (e.g. "
                "`model.state_dict(keep_vars=True)`, `model.parameters()`): each rank holds only its shard, so their "
                "values there are placeholders, not the weights. HINT: pass `model.state_dict()` (every rank), or the "
                "model itself, `fabric.save(path, {'model': model}, filter={'model': keep})`, so that every rank "
                "writes its shard."
            )
