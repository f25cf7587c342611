"""The user's param groups over this rank's shard: which elements each group owns, their masters, and the checks.

A bucket's shard is cut into *segments*, contiguous runs of one param group's elements; each gets an fp32 master.
``ParamGroupView`` keeps showing users and Lightning the model's own parameters while the wrapped optimizer steps
the masters.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.sharding.flat_bucket import FlatBucket

# Optimizers whose update of an element depends on other elements of the same tensor (factored moments, line
# searches, sparse rows) cannot run on a flat shard.
NOT_ELEMENTWISE: tuple[str, ...] = ("LBFGS", "SparseAdam", "Adafactor")


class Segment(NamedTuple):
    """A run of one param group's elements in this rank's shard of a bucket: ``shard[start:stop]``."""

    bucket: FlatBucket
    start: int
    stop: int
    group: int


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
    """Split this rank's shard of ``bucket`` into runs of consecutive elements that belong to one param group.

    Padding and parameters of other optimizers are skipped: they get no master and no optimizer state.
    """
    lo, hi = bucket.rank * bucket.shard_numel, (bucket.rank + 1) * bucket.shard_numel
    runs: list[Segment] = []
    for slot, param in bucket.slots_and_params():
        start, stop = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        group = group_of.get(id(param))
        if start >= stop or group is None:
            continue
        if runs and runs[-1].group == group and runs[-1].stop == start - lo:
            runs[-1] = runs[-1]._replace(stop=stop - lo)
        else:
            runs.append(Segment(bucket, start - lo, stop - lo, group))
    return runs


def master_for(segment: Segment, fp32: bool) -> Tensor:
    shard = segment.bucket.param_shard[segment.start : segment.stop]
    if shard.dtype == torch.float32 or not fp32:
        return shard  # the parameters are the master weights
    return shard.detach().to(torch.float32)


def trainable_named_groups(module: nn.Module, optimizer: Optimizer) -> list[list[tuple[str, nn.Parameter]]]:
    """Each param group's trainable parameters with their names; rejects what cannot be sharded, saying why."""
    kind = type(optimizer).__name__
    if kind in NOT_ELEMENTWISE:
        raise TypeError(
            f"{kind} cannot be sharded by ZeRO: its update of one element depends on other elements of the same "
            "parameter tensor, which lives on other ranks. HINT: use an element-wise optimizer such as AdamW or SGD."
        )
    names = {id(p): name for name, p in module.named_parameters()}
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
