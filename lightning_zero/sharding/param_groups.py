"""The user's param groups over this rank's shard: which elements each group owns, their masters, and the checks.

A bucket's shard is cut into *segments*, one per parameter (or the part of it this rank owns); each gets an fp32
master, so the wrapped optimizer holds one tensor per parameter exactly as it would under DDP (Note [one master per
parameter]). ``ParamGroupView`` keeps showing users and Lightning the model's own parameters while the wrapped
optimizer steps the masters.

Note [one master per parameter]
torch's optimizers skip a parameter whose ``.grad`` is None: no step count, no weight decay, no momentum. DDP keeps
that semantics for a parameter no rank used (``find_unused_parameters=True``), and so do we, which needs a master per
parameter: a master spanning several parameters has one ``.grad`` and one step count for all of them. The fp32
masters of adjacent segments are views into one tensor per *run* (consecutive segments of one param group), so
copying masters into the low-precision shards, and adopting edits (Note [edits reach the masters] in
``param_edits.py``), take one operation per run rather than per parameter.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, MutableMapping
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.sharding.activation_checkpointing import parameter_names
from lightning_zero.sharding.flat_bucket import FlatBucket

# torch's optimizers whose update of an element reads only that element's gradient and state: a flat shard of a
# parameter takes exactly the step the whole parameter would.
ELEMENTWISE: frozenset[str] = frozenset(
    {"SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop"}
)
# torch's optimizers whose update of an element depends on other elements of the same tensor (factored moments, line
# searches, sparse rows): they cannot run on a flat shard.
NOT_ELEMENTWISE: frozenset[str] = frozenset({"LBFGS", "SparseAdam", "Adafactor"})
_PROBE_STEPS = 3


class Segment(NamedTuple):
    """One parameter's elements in this rank's shard of a bucket: ``shard[start:stop]`` (Note [one master per
    parameter])."""

    bucket: FlatBucket
    start: int
    stop: int
    group: int
    slot: int = -1
    """The parameter's position in ``bucket.params`` (-1: a segment built by hand, not by ``segments_of``)."""


class MasterRun(NamedTuple):
    """Consecutive segments of one param group: ``shard[start:stop]`` and the fp32 tensor their masters view."""

    bucket: FlatBucket
    start: int
    stop: int
    master: Tensor

    @property
    def shard(self) -> Tensor:
        return self.bucket.param_shard[self.start : self.stop]


class ParamGroupView(MutableMapping[str, Any]):
    """A param group as users and Lightning see it: ``params`` are the model's parameters (so ``toggle_optimizer``
    and friends act on the model); every other key *is* the wrapped optimizer's group entry, so a learning rate set
    here, by a scheduler, or by the wrapped optimizer is one and the same value."""

    def __init__(self, group: dict[str, Any], params: list[nn.Parameter]) -> None:
        self._group = group
        self._params = params

    def __getitem__(self, key: str) -> Any:
        return self._params if key == "params" else self._group[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if key == "params":
            raise TypeError("The parameters of a sharded param group cannot be replaced after ZeroOptimizer wraps it.")
        self._group[key] = value

    def __delitem__(self, key: str) -> None:
        del self._group[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._group)

    def __len__(self) -> int:
        return len(self._group)

    def __repr__(self) -> str:
        return repr({k: (f"<{len(self._params)} parameters>" if k == "params" else v) for k, v in self._group.items()})


def segments_of(bucket: FlatBucket, group_of: dict[int, int]) -> list[Segment]:
    """One segment per parameter of ``bucket`` that has elements in this rank's shard.

    Padding and parameters of other optimizers are skipped: they get no master and no optimizer state.
    """
    lo, hi = bucket.rank * bucket.shard_numel, (bucket.rank + 1) * bucket.shard_numel
    segments: list[Segment] = []
    for position, (slot, param) in enumerate(bucket.slots_and_params()):
        start, stop = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        group = group_of.get(id(param))
        if start < stop and group is not None:
            segments.append(Segment(bucket, start - lo, stop - lo, group, position))
    return segments


def masters_for(segments: list[Segment], fp32: bool) -> tuple[list[Tensor], list[MasterRun]]:
    """Each segment's master, and the runs of separate fp32 masters (empty when the parameters are the masters).

    Parameters already fp32, or ``fp32=False`` (``bf16-true``): a segment's master is its parameter shard itself.
    Otherwise consecutive segments of one param group share one fp32 tensor (Note [one master per parameter]).
    """
    masters: list[Tensor] = []
    runs: list[MasterRun] = []
    i = 0
    while i < len(segments):
        first = segments[i]
        shard = first.bucket.param_shard
        if shard.dtype == torch.float32 or not fp32:
            masters.append(shard[first.start : first.stop])
            i += 1
            continue
        j = i + 1
        while j < len(segments) and _continues(segments[j - 1], segments[j]):
            j += 1
        last = segments[j - 1]
        run = MasterRun(first.bucket, first.start, last.stop, shard[first.start : last.stop].detach().float())
        runs.append(run)
        masters.extend(run.master[seg.start - first.start : seg.stop - first.start] for seg in segments[i:j])
        i = j
    return masters, runs


def _continues(previous: Segment, segment: Segment) -> bool:
    return segment.bucket is previous.bucket and segment.group == previous.group and segment.start == previous.stop


@torch.no_grad()
def adopt_edits(runs: list[MasterRun]) -> Tensor:
    """Give each master the value of its parameter element wherever that was edited since the last step (Note
    [edits reach the masters]): a masked copy, no host synchronization (unedited elements get their own master value
    back). Returns whether any element was adopted (0-d uint8, 0 or 1, on the masters' device)."""
    adopted = []
    for run in runs:
        edited = run.shard != run.master.to(run.shard.dtype)
        torch.where(edited, run.shard, run.master, out=run.master)
        # The largest byte rather than ``any()``: the same answer, ~100x faster on the CPU (torch 2.13, 4M elements).
        adopted.append(edited.view(torch.uint8).amax())
    return torch.stack(adopted).amax()


@torch.no_grad()
def copy_masters_to_shards(runs: list[MasterRun]) -> None:
    """Round the fp32 masters into the low-precision parameter shards (after a step)."""
    if runs:
        torch._foreach_copy_([run.shard for run in runs], [run.master for run in runs])


def trainable_named_groups(
    module: nn.Module, optimizer: Optimizer, elementwise: tuple[str, ...] = ()
) -> list[list[tuple[str, nn.Parameter]]]:
    """Each param group's trainable parameters with their names; rejects what cannot be sharded, saying why.

    ``elementwise``: optimizer class names the user declared element-wise (``ZeroConfig.elementwise_optimizers``).
    """
    check_elementwise(optimizer, elementwise)
    kind = type(optimizer).__name__
    # The names state_dict() gives: Note [checkpoint wrappers keep the names]
    names = parameter_names(module)
    seen: dict[int, int] = {}
    groups: list[list[tuple[str, nn.Parameter]]] = []
    for g, group in enumerate(optimizer.param_groups):
        named: list[tuple[str, nn.Parameter]] = []
        for p in group["params"]:
            name = names.get(id(p))
            if name is None:
                raise ValueError(
                    f"Param group {g} of {kind} holds a tensor of shape {tuple(p.shape)} that is not a parameter of "
                    f"the {type(module).__name__} being sharded. HINT: build the optimizer from "
                    "`model.parameters()` (or named subsets of them)."
                )
            if id(p) in seen:
                raise ValueError(
                    f"Parameter {name!r} appears in param group {seen[id(p)]} and again in param group {g} of "
                    f"{kind}. HINT: put each parameter in exactly one param group."
                )
            seen[id(p)] = g
            if p.requires_grad:
                named.append((name, p))
        groups.append(named)
    if not any(groups):
        raise ValueError(
            f"{kind} has no trainable parameters to shard (every param group is empty or frozen). HINT: pass the "
            "model's trainable parameters to the optimizer, e.g. `AdamW(model.parameters())`."
        )
    return groups


def check_elementwise(optimizer: Optimizer, declared: tuple[str, ...]) -> None:
    """Refuse an optimizer that ZeRO cannot run on flat shards, naming it and the way out.

    torch's element-wise optimizers (and subclasses that keep their ``step``) pass. Any other optimizer must be
    declared in ``ZeroConfig.elementwise_optimizers``, and is then stepped on a probe, whole and cut into flat pieces
    as ZeRO cuts parameters; if the two disagree it is refused anyway. (A probe of a few steps cannot see everything:
    an optimizer that starts preconditioning late passes it, hence the declaration.)
    """
    cls = type(optimizer)
    kind = cls.__name__
    if kind in NOT_ELEMENTWISE and cls.__module__.startswith("torch.optim"):
        raise TypeError(
            f"{kind} cannot be sharded by ZeRO: its update of one element depends on other elements of the same "
            "parameter tensor, which lives on other ranks. HINT: use an element-wise optimizer such as AdamW or SGD."
        )
    if _is_torch_elementwise(cls):
        return
    qualified = f"{cls.__module__}.{cls.__qualname__}"
    if kind not in declared and qualified not in declared:
        raise TypeError(
            f"{qualified} cannot be sharded by ZeRO unless it is element-wise, and ZeRO does not know whether it is: "
            "each rank steps only a flat slice of every parameter, so an optimizer that looks at whole tensors "
            "(LAMB and LARS trust ratios, Shampoo, SOAP, Muon, factored moments) would silently compute a "
            f"different update. HINT: if {kind} updates every element from that element's gradient and state "
            f"alone (like Adam or SGD), declare it: ZeroStrategy(elementwise_optimizers=({kind!r},)) or "
            "ZeroConfig(elementwise_optimizers=...); otherwise use an element-wise optimizer such as AdamW."
        )
    for g, group in enumerate(optimizer.param_groups):
        problem = _probe(optimizer, group)
        if problem is not None:
            raise TypeError(
                f"{qualified} is declared element-wise in ZeroConfig.elementwise_optimizers, but it is not: {problem} "
                f"(param group {g}). Its update depends on the shape or other elements of a parameter, so it "
                f"cannot run on ZeRO's flat shards. HINT: remove {kind!r} from elementwise_optimizers and use an "
                "element-wise optimizer such as AdamW."
            )


def _is_torch_elementwise(cls: type) -> bool:
    for base in cls.__mro__:
        if base.__module__.startswith("torch.optim") and base.__name__ in ELEMENTWISE:
            # A subclass may change the update: it passes only if it kept torch's step.
            return _unwrapped(getattr(cls, "step", None)) is _unwrapped(getattr(base, "step", None))
    return False


def _unwrapped(fn: Any) -> Any:
    while hasattr(fn, "__wrapped__"):  # torch's profiling and no-grad decorators
        fn = fn.__wrapped__
    return fn


def _probe(optimizer: Optimizer, group: dict[str, Any]) -> str | None:
    """Step a fresh instance of the optimizer's class with ``group``'s hyper-parameters on a (4, 6) tensor and on
    the same values cut into three flat pieces; describe the difference, or None if the results agree."""
    device = group["params"][0].device if group["params"] else torch.device("cpu")
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(4, 6, generator=generator)
    grads = [torch.randn(4, 6, generator=generator) for _ in range(_PROBE_STEPS)]
    cuts = [(0, 7), (7, 16), (16, 24)]  # uneven, as shard boundaries fall anywhere in a parameter
    hyper = {k: copy.deepcopy(v) for k, v in group.items() if k not in ("params", "param_names", "initial_lr")}
    whole = nn.Parameter(values.clone().to(device))
    pieces = [nn.Parameter(values.flatten()[a:b].clone().to(device)) for a, b in cuts]
    for params in ([whole], pieces):
        probe = _construct(type(optimizer), [{**hyper, "params": params}], hyper)
        if probe is None:
            return None  # cannot be built without the user's arguments: the declaration is all we have
        try:
            for grad in grads:
                flat = grad.flatten().to(device)
                if len(params) == 1:
                    params[0].grad = grad.to(device)
                else:
                    for param, (a, b) in zip(params, cuts, strict=True):
                        param.grad = flat[a:b].clone()
                probe.step()
        except Exception as error:  # any failure on 1-D pieces means it cannot run on shards
            return f"stepping it on a probe tensor raised {type(error).__name__}: {error}"
    split = torch.cat([p.detach().flatten() for p in pieces])
    if not torch.allclose(whole.detach().flatten(), split, rtol=1e-5, atol=1e-7):
        gap = (whole.detach().flatten() - split).abs().max().item()
        return (
            f"a (4, 6) probe tensor stepped whole and as three flat pieces differs by up to {gap:.3g} after "
            f"{_PROBE_STEPS} steps"
        )
    return None


def _construct(cls: type[Optimizer], groups: list[dict[str, Any]], hyper: dict[str, Any]) -> Optimizer | None:
    attempts: list[dict[str, Any]] = [{}, {"lr": hyper["lr"]}] if "lr" in hyper else [{}]
    for kwargs in attempts:
        try:
            return cls(groups, **kwargs)
        except TypeError:
            continue
    return None
