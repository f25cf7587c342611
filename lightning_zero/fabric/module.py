"""The set-up model as Fabric holds it: ``ZeroForwardModule``, the strategy's forward module; ``load_state_dict``
of a stage-3 model into its shards; the check that keeps stage-3 placeholders out of ``fabric.save``.

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

Note [load_state_dict into shards]
Scripts written for several strategies load pretrained weights into the set-up model with
``model.load_state_dict(state_dict, strict=...)`` unless the strategy is FSDP's (LitGPT's ``load_checkpoint``), after
the optimizers are set up. At stages 1 and 2 the model holds its full parameters and the optimizers their views, so
torch's copy is right. At stage 3 each parameter is a placeholder outside a forward (Note [placeholders] in
``sharding/flat_bucket.py``), into which torch's copy fails. So the stage-3 model's ``load_state_dict`` is
``fabric.load_raw``'s load (``load_full_state_dict``): each rank copies its ranges into its shards and their
optimizer masters; it is collective, as ``load_state_dict`` is on every rank of such a script.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from lightning_utilities import apply_to_collection
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_zero.checkpoint.sharded_checkpoint import load_pretrained

if TYPE_CHECKING:
    from lightning_zero.fabric.models import SetUpModel
    from lightning_zero.fabric.strategy import ZeroFabricStrategy


class ZeroForwardModule(Module):
    """The forward module of a model set up by ``ZeroFabricStrategy``: calls the model (Note [marked forward
    methods])."""

    def __init__(self, module: Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


class LoadedKeys(NamedTuple):
    """What ``nn.Module.load_state_dict`` returns."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def load_state_dict_into_shards(
    strategy: ZeroFabricStrategy,
    model: SetUpModel,
    state_dict: Mapping[str, Any],
    strict: bool = True,
    assign: bool = False,
) -> LoadedKeys:
    """``load_state_dict`` of the model set up at stage 3 (Note [load_state_dict into shards])."""
    if assign:
        raise ValueError(
            "`load_state_dict(assign=True)` on a stage-3 model would replace its sharded parameters. HINT: load "
            "with `assign=False`, or with `fabric.load_raw(path, model)`."
        )
    module = model.module
    load_pretrained(
        module, state_dict, model.optimizers, model.gatherer, prefix="", strict=strict, tiers=strategy._tiers
    )
    expected = module.state_dict(keep_vars=True).keys()
    return LoadedKeys([k for k in expected if k not in state_dict], [k for k in state_dict if k not in expected])


def refuse_released_parameters(state: dict[str, Any], module: Module) -> None:
    """Refuse a state whose plain entries hold stage-3 parameters outside a gather (``model.state_dict()`` taken in
    the loop, as scripts that save an adapter's state dict do): their values are placeholders (Note [placeholders] in
    ``sharding/flat_bucket.py``), and the file would hold NaN where the weights should be."""
    released = {p.untyped_storage().data_ptr() for p in module.parameters() if p.numel() > 1 and not any(p.stride())}
    released.discard(0)
    for name, value in state.items():
        if isinstance(value, Module | Optimizer):
            continue
        found: list[Tensor] = []
        apply_to_collection(value, Tensor, found.append)
        if any(t.untyped_storage().data_ptr() in released for t in found if t.device.type != "meta"):
            raise ValueError(
                f"`fabric.save` state {name!r} holds parameters of the stage-3 model taken outside a forward (e.g. "
                "`model.state_dict()`): each rank holds only its shard, so their values there are placeholders, not "
                "the weights. HINT: pass the model itself, `fabric.save(path, {'model': model}, filter={'model': "
                "keep})`, so that every rank writes its shard, or take the state dict inside "
                "`with fabric.strategy.gathered_parameters():` (on every rank)."
            )
