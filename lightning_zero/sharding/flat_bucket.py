"""``FlatBucket``: parameters that communicate together, flattened into one padded buffer.

Every ZeRO stage is built on this layout. A bucket holds parameters of one optimizer param group and one dtype as
views into a single flat tensor, padded so that it splits into ``world_size`` equal, contiguous shards; rank ``r``
owns shard ``r`` of every bucket. Balancing is by elements, not by parameter count: a parameter may straddle two
ranks' shards, and every rank owns the same number of elements.

    flat:  | p0 ............ | p1 .... | p2 ........... |pad|      (padded_numel = world * shard_numel)
    owner: | rank 0             | rank 1             |  ...

Note [bucket order]
Buckets are filled walking the parameters in *reverse* registration order, because backward produces gradients
roughly in reverse of forward, and buckets are numbered in the order they close. Gradient buckets are launched
strictly in one order on every rank (a collective issued out of order on one rank would pair with a different
bucket on another and hang or corrupt both), so this numbering is also what makes early buckets ready early. A model
whose backward runs in another order (an encoder-decoder, a module called in a different order than registered)
would hold every bucket until an early-numbered one completes; as DDP rebuilds its buckets, the reducer therefore
records the order in which buckets complete in the first backward that reduces, and from then on launches them in
rank 0's recorded order (``LaunchOrder`` in ``launch_order.py``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_zero.compat import swap_storage_memory


@dataclass(frozen=True, slots=True)
class ParamSlot:
    """Where one parameter lives inside its bucket."""

    fqn: str
    """Fully-qualified name in the module, for messages and checkpoints."""
    offset: int
    numel: int
    shape: torch.Size


class FlatBucket:
    """A padded flat buffer whose views are the module's parameters, sharded evenly across ranks.

    A *resident* bucket (stages 1 and 2, and small persistent parameters in stage 3) keeps the full buffer for its
    whole life; ``param_shard`` is a view into it. A *sharded* bucket (stage 3) keeps only ``param_shard``, a separate
    tensor; the full buffer's memory exists only between ``allocate_full()`` and ``release()``, and in between the
    parameters are placeholders (Note [placeholders]). Either way the parameter objects themselves never change, so
    optimizers, tied weights and user references keep working.

    Note [placeholders]
    A released parameter keeps its shape: it is one NaN element expanded (stride 0) to the parameter's shape. Code
    that inspects parameters outside a forward, such as ``configure_optimizers`` splitting weight decay on
    ``p.ndim``, Lightning's model summary counting ``p.numel()``, sees the real model while it costs one element
    of memory. A stray read computes with NaN (loudly wrong) rather than touching freed memory, and a write fails.

    Note [freeing saved views]
    Autograd saves views of parameters for backward (``linear`` keeps ``weight.t()``). Those views hold the full
    buffer's *storage*, so dropping the buffer or re-pointing the parameters would free nothing until backward. A
    sharded bucket therefore keeps one full tensor for its whole life and resizes its storage to zero bytes on
    release, which frees the memory under every view at once; the next gather resizes the same storage back and
    fills it, so views saved in forward read the right values again in backward.
    """

    def __init__(
        self,
        index: int,
        group_index: int,
        named_params: Sequence[tuple[str, nn.Parameter]],
        rank: int,
        world_size: int,
        *,
        resident: bool = True,
    ) -> None:
        assert named_params, "a bucket holds at least one parameter"
        self.index = index
        """Position in the launch order (see Note [bucket order])."""
        self.group_index = group_index
        """The optimizer param group of every parameter here (stages 1 and 2); -1 when groups are mixed (stage 3)."""
        self.params: list[nn.Parameter] = [p for _, p in named_params]
        self.rank = rank
        self.world_size = world_size
        self.resident = True
        """Whether the full buffer lives as long as the bucket; see ``make_sharded()``."""
        first = self.params[0]
        self.dtype = first.dtype
        self.device = first.device
        self.trainable = first.requires_grad
        """All parameters of a bucket share ``requires_grad``: frozen ones get neither gradients nor optimizer state."""

        slots: list[ParamSlot] = []
        offset = 0
        for fqn, p in named_params:
            slots.append(ParamSlot(fqn, offset, p.numel(), p.shape))
            offset += p.numel()
        self.slots: tuple[ParamSlot, ...] = tuple(slots)
        self.numel = offset
        self.shard_numel = -(-offset // world_size)  # ceil: the padding is < world_size elements
        self.padded_numel = self.shard_numel * world_size

        # Zero padding keeps every reduction and norm over the flat buffer exact.
        flat = torch.zeros(self.padded_numel, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for slot, p in zip(self.slots, self.params, strict=True):
                flat[slot.offset : slot.offset + slot.numel].copy_(p.detach().reshape(-1))
        self.data: Tensor | None = None
        """The full flat parameters: always present when resident, only while gathered otherwise."""
        fill = float("nan") if self.dtype.is_floating_point else 0
        self._placeholder = torch.full((), fill, dtype=self.dtype, device=self.device)  # Note [placeholders]
        self._shard: Tensor | None = None
        self.releases = 0
        """Times the full buffer was freed: whether values gathered earlier are still these (Note [edits discarded at
        exit] in ``stage3/outside_step.py``)."""
        self._full = flat  # sharded buckets keep this tensor and resize its storage: Note [freeing saved views]
        self.attach(flat)
        if not resident:
            self.make_sharded()

    # -- views --------------------------------------------------------------------------------------------------
    @staticmethod
    def param_view(flat: Tensor, slot: ParamSlot) -> Tensor:
        return flat[slot.offset : slot.offset + slot.numel].view(slot.shape)

    def shard_of(self, flat: Tensor) -> Tensor:
        """This rank's contiguous shard of a bucket-shaped flat tensor."""
        return flat[self.rank * self.shard_numel : (self.rank + 1) * self.shard_numel]

    @property
    def param_shard(self) -> Tensor:
        """This rank's shard of the parameters: the slice the optimizer updates (persistent in every mode)."""
        if self._shard is not None:
            return self._shard
        assert self.data is not None
        return self.shard_of(self.data)

    def slots_and_params(self) -> Iterator[tuple[ParamSlot, nn.Parameter]]:
        return zip(self.slots, self.params, strict=True)

    # -- storage (sharded buckets) ----------------------------------------------------------------------------------
    @property
    def full_nbytes(self) -> int:
        """Bytes of the full flat buffer (``padded_numel`` elements)."""
        return self.padded_numel * self._full.element_size()

    def allocate_full(self, memory: Tensor | None = None) -> Tensor:
        """The full flat buffer with its memory allocated, uninitialized: the target of an all-gather. ``memory``, a
        tensor returned by ``release(keep_memory=True)`` of a bucket with the same ``full_nbytes`` and device, gives
        its memory instead of a new allocation (Note [gathered buffers reused] in ``stage3/gathered_buffers.py``)."""
        storage = self._full.untyped_storage()
        if storage.nbytes() == 0:
            if memory is not None:
                assert memory.untyped_storage().nbytes() == self.full_nbytes, "reused memory of another size"
                swap_storage_memory(storage, memory.untyped_storage())  # leaves memory empty
            else:
                storage.resize_(self.full_nbytes)
        return self._full

    def attach(self, flat: Tensor) -> None:
        """Make ``flat`` the full buffer and every parameter a view into it."""
        self.data = flat
        for slot, p in self.slots_and_params():
            p.data = self.param_view(flat, slot)

    @torch.no_grad()
    def reattach(self) -> bool:
        """Point parameters given a new tensor (``p.data = tensor``) back at the full buffer, their values copied
        into it (Note [edits reach the masters] in ``param_edits.py``). Whether any was."""
        assert self.data is not None
        flat = self.data
        base, size = flat.data_ptr(), flat.element_size()
        moved = False
        for slot, param in self.slots_and_params():
            if slot.numel == 0 or param.data_ptr() == base + slot.offset * size:
                continue
            new = param.data
            if new.shape != slot.shape or new.dtype != flat.dtype or new.device != flat.device:
                raise RuntimeError(
                    f"Parameter {slot.fqn!r} was given a new tensor (`param.data = ...`) of shape "
                    f"{tuple(new.shape)}, {new.dtype} on {new.device}; ZeRO holds it as {tuple(slot.shape)}, "
                    f"{flat.dtype} on {flat.device}, in a flat buffer it shards and gathers. HINT: write the values in "
                    "place instead (`with torch.no_grad(): param.copy_(values)`), or change the model before ZeRO "
                    "wraps it."
                )
            view = self.param_view(flat, slot)
            view.copy_(new)
            param.data = view
            moved = True
        return moved

    def make_sharded(self) -> None:
        """Keep only this rank's shard from now on and free the full buffer (a resident bucket becomes sharded)."""
        assert self.data is not None
        self._shard = self.shard_of(self.data).clone()
        self.resident = False
        self.release()

    def release(self, keep_memory: bool = False) -> Tensor | None:
        """Free the full buffer (sharded buckets only): parameters become placeholders (Note [placeholders]). With
        ``keep_memory`` its memory is not freed but moved into a tensor that is returned, for ``allocate_full`` of
        a bucket of the same size to take over (Note [gathered buffers reused] in ``stage3/gathered_buffers.py``)."""
        assert not self.resident, "a resident bucket keeps its parameters"
        self.releases += 1
        for slot, p in self.slots_and_params():
            p.data = self._placeholder.expand(slot.shape)
        self.data = None
        storage = self._full.untyped_storage()  # Note [freeing saved views]
        if keep_memory and storage.nbytes() > 0:
            holder = torch.empty(0, dtype=torch.uint8, device=self.device)
            swap_storage_memory(storage, holder.untyped_storage())  # leaves storage empty
            return holder
        storage.resize_(0)
        return None

    def __repr__(self) -> str:
        return (
            f"FlatBucket(index={self.index}, group={self.group_index}, params={len(self.params)}, "
            f"numel={self.numel}, padded={self.padded_numel}, dtype={self.dtype}, resident={self.resident})"
        )


def build_buckets(
    groups: Sequence[Sequence[tuple[str, nn.Parameter]]],
    bucket_numel: int,
    rank: int,
    world_size: int,
    registration_order: Sequence[nn.Parameter],
) -> list[FlatBucket]:
    """Pack each param group's parameters into buckets of about ``bucket_numel`` elements, per dtype.

    ``registration_order`` is the module's parameter order; buckets are filled walking it in reverse and numbered as
    they close (see Note [bucket order]). A bucket never mixes param groups or dtypes.
    """
    position = {id(p): i for i, p in enumerate(registration_order)}
    members: list[tuple[int, int, str, nn.Parameter]] = []  # (position, group, fqn, param)
    for g, named in enumerate(groups):
        members.extend((position[id(p)], g, fqn, p) for fqn, p in named)
    members.sort(key=lambda m: m[0], reverse=True)

    open_buckets: dict[tuple[int, torch.dtype], list[tuple[str, nn.Parameter]]] = {}
    open_numel: dict[tuple[int, torch.dtype], int] = {}
    closed: list[tuple[int, list[tuple[str, nn.Parameter]]]] = []
    for _, g, fqn, p in members:
        key = (g, p.dtype)
        open_buckets.setdefault(key, []).append((fqn, p))
        open_numel[key] = open_numel.get(key, 0) + p.numel()
        if open_numel[key] >= bucket_numel:
            closed.append((g, open_buckets.pop(key)))
            del open_numel[key]
    closed.extend((g, named) for (g, _), named in open_buckets.items())
    return [FlatBucket(i, g, named, rank, world_size) for i, (g, named) in enumerate(closed)]
