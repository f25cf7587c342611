"""``HostAdam``: torch's Adam and AdamW stepped on host memory one bucket at a time, over flat per-bucket moments.

Note [bucketed host Adam]
The host tier's step is bound by memory traffic (Note [tier step kernels]): an AdamW update reads and writes each
master and both moments and reads the gradient, 28 bytes per fp32 parameter, once, in torch's fused CPU kernel. What
``torch.optim.AdamW.step()`` adds around that kernel is Python per parameter (``_init_group``, grouping by device and
dtype), state allocated one tensor per parameter, and the param groups read while the step runs. ``HostAdam`` does the
same arithmetic with none of that:

- the moments of a bucket's segments (``exp_avg``, ``exp_avg_sq``, with ``amsgrad`` ``max_exp_avg_sq``) are views
  into one flat tensor per bucket and name, allocated at the bucket's first step as torch allocates them (zeros, the
  master's dtype); ``optimizer.state[master]`` holds exactly torch's entries (a float32 0-d ``step`` per segment, then
  the moments), so ``state_dict()`` is torch's format and checkpoints stay exchangeable with any run. A state loaded
  from a checkpoint (``load_state_dict`` replaces the tensors) is copied into the flat tensors at the next step and
  the entries point at the views again;
- ``prepare`` runs on the training thread: it picks the segments with a gradient (torch's rule: a parameter whose
  ``.grad`` is None takes no step, Note [unused parameters]) and reads the hyperparameters from their param group
  now (a learning rate changed later by a scheduler belongs to the next step). What it returns touches only tensors
  and may run on a worker thread (Note [host step threads]);
- the update is one call of torch's own fused kernel (``torch._fused_adamw_``, or ``_fused_adam_`` without
  decoupled weight decay) per bucket and param group, over views of the bucket's flat masters, gradients and
  moments (joined into runs: Note [one kernel call per bucket]), with the per-parameter step counts incremented
  first as torch does: element for element the same arithmetic as ``AdamW(fused=True)``, so a run through
  ``HostAdam`` and one through torch's step agree bit for bit.

Note [one kernel call per bucket]
A param group's stepped segments of a bucket mostly lie back to back in one storage, for the masters, the
gradients and each moment alike (the host tier's buffers, a CPU device's parameter and gradient shards, the flat
moments). Where their step counts agree, the kernel is called over flat views of those runs instead of one tensor
per segment, with one of the counts per run (all of them incremented first). A run ends after a segment that is
not a whole number of 64-byte units (``_TASK_BYTES``): torch's kernel rounds the last ``n % vector width``
elements of a tensor in a scalar loop, and ``exp_avg_sq`` comes out of it a bit differently, so an element must
take the same loop joined as alone. Then every element gets the same arithmetic with the same bias corrections:
bit for bit the same result (``tests/test_host_adam.py``). What it saves is the kernel's per-tensor work, most of
all its OpenMP fork and barrier per tensor: with two intra-op threads on two loaded cores torch's kernel over 24
tensors of 4M elements took 2x the time of the same elements in 6 tensors of 16M (a throwaway script, load average
10, 2026-11-28), and 0.94x at one thread. The counts are compared (one ``torch.equal`` each, host tensors) only when
the list of step tensors is not the one of the group's last call, which incremented all of them at once: the first
step, a checkpoint load, a step of only some segments (a parameter without a gradient, Note [unused parameters] in
``sharding/gradient_presence.py``). Counts that differ take one tensor per segment, as before.

It covers the groups for which the tiers chose (or the user set) torch's fused kernels on an unmodified
``torch.optim.Adam`` or ``AdamW`` (Note [tier step kernels]); any other optimizer or group keeps the generic path,
``optimizer.step()`` on the bucket's narrowed param groups.

Note [tier step kernels]
The tiers' step runs on host memory (the host tier, the disk tier, the CPU device), where its speed is the memory
traffic of the update. torch's multi-tensor (``foreach``) Adam makes one pass over memory per elementary operation,
about 80 bytes per fp32 parameter; its fused CPU kernels (``fused=True``: Adam, AdamW, SGD, Adagrad) read and write
each parameter, gradient and moment once, as DeepSpeed's ``DeepSpeedCPUAdam`` does, and run at that kernel's speed
(``benchmarks/host_step.py``). So with ``offload_optimizer`` on, every param group whose ``foreach`` and ``fused``
the user left to torch (``None``), and whose tensors are all floating-point on the host, steps fused; a group of
another optimizer, or with device tensors (the masters of buckets ``offload_ratio`` leaves on a GPU), takes the
multi-tensor kernels in the host tier and torch's default elsewhere. An explicit ``foreach=`` or ``fused=`` in the
optimizer's defaults or a param group is kept. The fused kernels round differently from the single-tensor and
multi-tensor ones (a few ULPs per step): a tiered run matches DDP within the parity tests' 1e-5, not bit for bit;
the host tier with and without its copy path chooses the same kernels and agrees exactly.

The fused kernels write the parameters and moments without moving their version counters (torch 2.13: after
``AdamW(fused=True).step()`` ``p._version`` and ``exp_avg._version`` are unchanged), which is how the swapper tells
a modified entry from a clean one (Note [swap lifecycle]): unmarked, a stepped master, moment or fp32 parameter shard
on disk would be freed without being written, and the next step would read the old values. So after each tiered
bucket's step the tiers bump the counters of the masters and element-wise state of its fused groups' stepped
segments (``OptimizerTiers._mark_stepped`` in ``optimizer_tiers.py``; ``DiskMoments.unload`` for the
moments on disk).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_zero.compat import fused_adam_kernel
from lightning_zero.offload.host_arena import huge_pages, zeros_on_huge_pages
from lightning_zero.sharding.optimizer_hooks import without_step_hooks

_FUSED_ON_CPU = (torch.optim.Adam, torch.optim.SGD, torch.optim.Adagrad)  # AdamW is an Adam
"""torch optimizers with fused CPU kernels (``fused=True``); a subclass counts if it keeps their ``step``."""


def choose_step_kernels(optimizer: torch.optim.Optimizer, multi_tensor: bool) -> None:
    """The kernels of a tiered step, per param group the user left to torch (Note [tier step kernels])."""
    step = without_step_hooks(type(optimizer).step)  # torch wraps each class's step once, for its hooks
    fusable = any(isinstance(optimizer, cls) and step is without_step_hooks(cls.step) for cls in _FUSED_ON_CPU)
    for group in optimizer.param_groups:
        if "foreach" not in group or group["foreach"] is not None or group.get("fused"):
            continue  # no choice to make, or the user's
        params: list[Tensor] = group["params"]
        host_floats = all(p.device.type == "cpu" and p.is_floating_point() for p in params)
        # torch's fused SGD takes a momentum step only when every parameter of the call has a momentum buffer or
        # none has: a parameter stepped for the first time beside ones stepped before (a LoRA adapter or an expert
        # whose first gradient comes late, Note [unused parameters]) fails inside the kernel. So SGD with momentum
        # keeps the multi-tensor kernels.
        sgd_momentum = isinstance(optimizer, torch.optim.SGD) and group.get("momentum", 0) != 0
        if (
            fusable
            and host_floats
            and not sgd_momentum
            and group.get("fused", False) is None
            and not group.get("differentiable")
        ):
            group["fused"] = True
        elif multi_tensor:
            group["foreach"] = True


_MOMENTS = ("exp_avg", "exp_avg_sq")
_AMSGRAD = "max_exp_avg_sq"
MOMENT_NAMES = (*_MOMENTS, _AMSGRAD)
"""Every per-element state entry ``HostAdam`` keeps in flat tensors."""


def covers_optimizer(optimizer: Optimizer) -> bool:
    """Whether ``optimizer`` is torch's Adam or AdamW (or a subclass that keeps their ``step``)."""
    if not isinstance(optimizer, torch.optim.Adam):
        return False
    step = without_step_hooks(type(optimizer).step)
    return step is without_step_hooks(torch.optim.Adam.step) or step is without_step_hooks(torch.optim.AdamW.step)


def covers_group(group: dict[str, Any]) -> bool:
    """Whether a param group of a covered optimizer steps with torch's fused kernels on the host."""
    return bool(group.get("fused")) and not group.get("differentiable") and not group.get("capturable")


_TASK_BYTES = 64
"""torch's fused CPU kernels split a tensor into tasks of whole 64-byte units and run each task's elements through
their vector loop, all but its last ``n % width`` (a scalar loop that rounds ``exp_avg_sq`` differently); with
vectors of at most 64 bytes, an element 64-byte units into a tensor takes the vector loop wherever the tensor ends."""


def _follows(before: Tensor, after: Tensor) -> bool:
    """Whether ``after`` starts where ``before`` ends, in the same storage, both contiguous of one dtype."""
    return (
        after.data_ptr() == before.data_ptr() + before.numel() * before.element_size()
        and after.dtype == before.dtype
        and after.is_contiguous()
        and before.is_contiguous()
        and after.untyped_storage().data_ptr() == before.untyped_storage().data_ptr()
    )


def _runs(lists: list[list[Tensor]]) -> list[list[Tensor]]:
    """Each list of tensors joined into flat views of its runs: the longest stretches that lie back to back in every
    list, each tensor but a run's last a whole number of 64-byte units (Note [one kernel call per bucket])."""
    first = lists[0]
    unit = _TASK_BYTES // first[0].element_size()
    breaks = [0]
    for k in range(1, len(first)):
        if first[k - 1].numel() % unit or not all(_follows(lst[k - 1], lst[k]) for lst in lists):
            breaks.append(k)
    bounds = list(zip(breaks, [*breaks[1:], len(first)], strict=True))
    return [[_join(lst[a:b]) for a, b in bounds] for lst in lists]


def _join(tensors: list[Tensor]) -> Tensor:
    start = tensors[0].detach()  # a master is a leaf that requires grad; the kernel writes through the view
    return start.as_strided((sum(t.numel() for t in tensors),), (1,))


@dataclass(eq=False)
class _Bucket:
    key: int
    segments: list[int]
    """Indices of the bucket's segments (into the optimizer's segment and master lists)."""
    starts: list[int]
    """Each segment's first element, relative to the bucket's first segment."""
    numel: int
    flats: dict[str, Tensor] = field(default_factory=dict)
    """Per moment name: (numel,) flat tensor whose views are the segments' state entries."""
    views: dict[str, list[Tensor]] = field(default_factory=dict)
    collapsed: set[int] = field(default_factory=set)
    """Addresses of the masters' spans collapsed into huge pages (Note [huge pages])."""
    even: dict[int, list[Tensor]] = field(default_factory=dict)
    """Per param group: the step counts of its last call, known to hold one value (Note [one kernel call per
    bucket])."""


class HostAdam:
    """The bucketed Adam/AdamW of Note [bucketed host Adam] for ``optimizer`` (the user's, re-targeted at masters)."""

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer
        self._buckets: dict[int, _Bucket] = {}
        self.allocate: Callable[[int, str, int, torch.dtype], Tensor] = lambda _, __, n, dtype: zeros_on_huge_pages(
            n, dtype
        )
        """Where a bucket's flat moments come from, given the bucket's key, the moment's name, its size and dtype
        (zeros); the tiers may place them elsewhere (Note [moments on disk] in ``host_moments.py``)."""

    def covers(self, groups: Sequence[int]) -> bool:
        """Whether every param group in ``groups`` (indices) is stepped here."""
        param_groups = self.optimizer.param_groups
        return covers_optimizer(self.optimizer) and all(covers_group(param_groups[g]) for g in groups)

    def add_bucket(self, key: int, segments: list[int], starts: list[int], stops: list[int]) -> None:
        """Register a bucket: its segments' indices and their ``[start, stop)`` in shard coordinates."""
        first = min(starts, default=0)
        self._buckets[key] = _Bucket(key, segments, [s - first for s in starts], max(stops, default=0) - first)

    def owner(self, segment: int) -> int | None:
        """The key of the bucket holding ``segment`` (an index into the optimizer's segments), if any."""
        return next((key for key, b in self._buckets.items() if segment in b.segments), None)

    def state_view(self, key: int, segment: int, name: str, masters: Sequence[Tensor]) -> Tensor:
        """Segment ``segment``'s view of the bucket's flat ``name`` (created if need be): where a checkpoint loads
        that state entry."""
        bucket = self._buckets[key]
        self._ensure_flats(bucket, masters, (name,))
        return bucket.views[name][bucket.segments.index(segment)]

    def flat_state(self, key: int) -> dict[str, Tensor]:
        """The bucket's flat moments (empty before its first step)."""
        return self._buckets[key].flats

    def prepare(self, key: int, masters: Sequence[Tensor], groups: Sequence[int]) -> Callable[[], None] | None:
        """On the training thread: the bucket's update, as a function of tensors only (None: nothing to step).
        ``masters`` and ``groups``: every segment's master (with ``.grad`` set where it steps) and param group."""
        bucket = self._buckets[key]
        state = self.optimizer.state
        by_group: dict[int, list[int]] = {}
        for k, i in enumerate(bucket.segments):
            if masters[i].grad is not None:
                by_group.setdefault(groups[i], []).append(k)
        if not by_group:
            return None
        calls: list[tuple[Any, ...]] = []
        collapse: list[Tensor] = []
        for g, positions in by_group.items():
            group = self.optimizer.param_groups[g]
            amsgrad = bool(group["amsgrad"])
            self._ensure_state(bucket, masters, amsgrad, positions)
            params = [masters[bucket.segments[k]] for k in positions]
            entries = [state[p] for p in params]
            grads: list[Tensor] = [p.grad for p in params]  # type: ignore[misc]  # (set: stepped segments only)
            moments = [[e[name] for e in entries] for name in (*_MOMENTS, *((_AMSGRAD,) if amsgrad else ()))]
            beta1, beta2 = (float(b) if isinstance(b, Tensor) else b for b in group["betas"])
            decoupled = group.get("decoupled_weight_decay", isinstance(self.optimizer, torch.optim.AdamW))
            kernel = fused_adam_kernel(decoupled)
            hyper = {
                "lr": group["lr"],
                "beta1": beta1,
                "beta2": beta2,
                "weight_decay": group["weight_decay"],
                "eps": group["eps"],
                "amsgrad": amsgrad,
                "maximize": group["maximize"],
            }
            steps = [e["step"] for e in entries]
            if self._together(bucket, g, steps):  # Note [one kernel call per bucket]
                params, grads, *moments = _runs([params, grads, *moments])
                read = [steps[0]] * len(params)
            else:
                read = steps
            for master in params:
                if master.data_ptr() not in bucket.collapsed:  # written before the first step: Note [huge pages]
                    bucket.collapsed.add(master.data_ptr())
                    collapse.append(master)
            calls.append((kernel, params, grads, moments, steps, read, hyper))

        def run() -> None:
            for span in collapse:  # once per bucket, on the worker: a copy of the masters
                huge_pages(span, collapse=True)
            for kernel, params, grads, moments, steps, read, hyper in calls:
                torch._foreach_add_(steps, 1)
                kernel(params, grads, moments[0], moments[1], moments[2] if len(moments) > 2 else [], read, **hyper)

        return run

    def _together(self, bucket: _Bucket, group: int, steps: list[Tensor]) -> bool:
        """Whether the step counts agree (Note [one kernel call per bucket]): compared only when the list of step
        tensors is not the one of the group's last call, which incremented all of them at once."""
        known = bucket.even.get(group)
        if known is not None and len(known) == len(steps) and all(a is b for a, b in zip(known, steps, strict=True)):
            return True
        first = steps[0]  # the counts changed hands (the first step, a load, a step of only some segments)
        if all(torch.equal(s, first) for s in steps[1:]):
            bucket.even[group] = list(steps)
            return True
        bucket.even.pop(group, None)
        return False

    def _ensure_state(self, bucket: _Bucket, masters: Sequence[Tensor], amsgrad: bool, positions: list[int]) -> None:
        """torch's state entries for these segments, their moments views of the flat tensors (created at the first
        step, adopted after a load)."""
        state = self.optimizer.state
        names = (*_MOMENTS, _AMSGRAD) if amsgrad else _MOMENTS
        self._ensure_flats(bucket, masters, names)
        for k in positions:
            master = masters[bucket.segments[k]]
            entry = state[master]
            if not entry:  # torch's _init_group: a float32 step for the fused kernels, then the moments
                entry["step"] = torch.zeros((), dtype=torch.float32)
                for name in names:
                    entry[name] = bucket.views[name][k].zero_()
                continue
            for name in names:
                view = bucket.views[name][k]
                value = entry.get(name)
                if value is view:
                    continue
                if value is None:  # amsgrad switched on after steps without it: torch starts it from zero
                    view.zero_()
                else:
                    view.copy_(value)  # loaded from a checkpoint: the flat tensors take it
                entry[name] = view
            step = entry["step"]
            if step.dtype != torch.float32 or step.device.type != "cpu":
                entry["step"] = step.to(device="cpu", dtype=torch.float32)

    def _ensure_flats(self, bucket: _Bucket, masters: Sequence[Tensor], names: Sequence[str]) -> None:
        dtype = masters[bucket.segments[0]].dtype
        for name in names:
            if name not in bucket.flats:
                flat = bucket.flats[name] = self.allocate(bucket.key, name, bucket.numel, dtype)
                sizes = [masters[i].numel() for i in bucket.segments]
                bucket.views[name] = [flat[a : a + n] for a, n in zip(bucket.starts, sizes, strict=True)]
