"""``ParamEdits``: which parameter shards something other than the step wrote since the step last wrote them.

Note [edits reach the masters]
Where the masters are separate from the parameters (fp32 masters of low-precision parameters; the host tier's
masters in host memory, even in fp32), the parameter shards are rounded or copied from the masters after every
step. Anything may write the parameters in between: ``load_state_dict``, an EMA swap, ``gathered_parameters(...,
writeback=True)``, ``p.data.copy_(...)``, ``p.data.clamp_(...)``, ``p.data = tensor``; the next step must start
from what they wrote. Version counters do not see all of these: a write through ``p.data`` moves no counter (the
alias ``.data`` returns has its own), and a parameter does not share a counter with the flat buffer it views
(``FlatBucket.attach`` sets ``p.data``). So the check is by content, on the shard's device, before each step:

- where the fp32 masters are on the shard's device (mixed precision without tiers) nothing is decided on the host:
  before the bucket is stepped, every master takes the value of its parameter element wherever the two differ
  after rounding (``adopt``: a masked copy, ``torch.where(shard != master.to(shard.dtype), shard, master)``; an
  element nobody edited gets its own master value back). That is exact and needs no host read, so a steady
  mixed-precision step has none for the edit check (``tests/test_host_syncs.py``). It costs the comparison a host
  decision would need anyway (the rounding and ``!=``: about 12 bytes of memory traffic per element) and the masked
  copy (about 11 more), against the optimizer's own passes over its 16 bytes of fp32 state per element. Which
  buckets adopted an edit is counted on the device (``flagged`` reads the count: tests and benchmarks, never the
  step);
- where they are not (the host tier's host masters, in fp32 too; masters on disk), adopting needs the shard where
  the masters are: the host would have to read it back, a device-to-host copy of the shard per step. Instead,
  after the step writes such a shard, ``record`` keeps a *digest* of its bytes, on the shard's device: the bytes,
  as 16-bit integers, in rows of ``_ROW``, each row's dot product with two fixed vectors of random integers below
  2**15. The arithmetic is float64 with every partial sum an integer below 2**53, so it is exact and does not
  depend on the summation order (the same bits give the same digest on any device, in any kernel); before the
  next step, ``check`` computes the digest again and compares the two on the device, and the host reads one flag
  per bucket (one read per step): only the buckets flagged adopt edits (the host tier reading the shard back
  first). Whether to copy a shard to the host is decided on the host, so the tiers keep this read.

A changed row goes unseen only if the change keeps both of its dot products: never for one changed element (each
weight is non-zero and the arithmetic exact), and, for edits that change several elements of one row, as rarely as
two random integers below 2**15 agree twice. A steady step of the host tier thus copies no parameter to the host:
it costs two passes over the shard on the device (the digests, about 18 bytes of memory traffic per 2 bytes of
shard each: a float64 conversion and a matrix product) and the one host read. A shard held by a tier between steps
(disk, the host store) cannot be digested in place and is compared every step.

``p.data = tensor`` on a parameter takes it out of its bucket's flat buffer (the step and the all-gather would no
longer reach it). ``FlatBucket.reattach`` finds it by its data pointer, copies its values into the buffer and
points the parameter back at it, so it is an edit like any other: ``check`` does so for resident buckets, a stage-3
``gathered(writeback=True)`` before it writes back. A tensor of another shape, dtype or device is refused, naming
the parameter.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from lightning_zero.sharding.flat_bucket import FlatBucket
from lightning_zero.sharding.param_groups import MasterRun, adopt_edits

_ROW = 1024
"""16-bit words per row of a digest: the digest is 1/256 of the shard's bytes."""
_BLOCK_ROWS = 4096
"""Rows converted to float64 at a time: 32 MiB of temporary memory."""


def digest_weights(device: torch.device) -> Tensor:
    """The fixed random integer weights of ``digest`` on ``device``: (``_ROW``, 2) float64."""
    generator = torch.Generator().manual_seed(0x5EED)
    return torch.randint(1, 1 << 15, (_ROW, 2), generator=generator).to(device=device, dtype=torch.float64)


def digest(shard: Tensor, weights: Tensor) -> Tensor:
    """(rows, 2) float64: each ``_ROW`` 16-bit words of ``shard``'s bytes dotted with ``weights`` (the last row
    zero-padded). Exact (Note [edits reach the masters])."""
    flat = shard.detach().reshape(-1)
    words = flat.view(torch.int8) if flat.element_size() == 1 else flat.view(torch.int16)
    n = words.numel()
    rows = -(-n // _ROW)
    out = torch.empty(rows, 2, dtype=torch.float64, device=shard.device)
    for first in range(0, rows, _BLOCK_ROWS):
        last = min(rows, first + _BLOCK_ROWS)
        a, b = first * _ROW, min(n, last * _ROW)
        block = torch.empty((last - first) * _ROW, dtype=torch.float64, device=shard.device)
        block[: b - a].copy_(words[a:b])
        block[b - a :].zero_()  # the last row's padding
        torch.mm(block.view(last - first, _ROW), weights, out=out[first:last])
    return out


class ParamEdits:
    """The edit check of one optimizer (Note [edits reach the masters]): ``watch`` the buckets whose shards the step
    writes from separate masters; ``check`` before a step; ``adopt`` (or ``edited``) during it; ``record`` after
    each write."""

    def __init__(self, resident: Iterable[FlatBucket]) -> None:
        self._resident = [b for b in resident if b.resident]
        """Buckets whose parameters view a flat buffer for good: checked for ``p.data = tensor``."""
        self._compared: dict[int, list[MasterRun]] = {}
        """Buckets whose fp32 masters are on the shard's device: their masters adopt edits by a masked copy."""
        self._watched: dict[int, FlatBucket] = {}
        """Buckets whose masters are elsewhere (the host tier, the disk tier): their shards are digested."""
        self._always: set[int] = set()
        """Buckets with separate masters whose shard a tier holds: compared every step."""
        self._digests: dict[int, Tensor] = {}
        self._weights: dict[torch.device, Tensor] = {}
        self._edited: set[int] = set()
        self._found_here = 0
        """Buckets found edited on the host (by digest, or reattached)."""
        self._found_on: dict[torch.device, Tensor] = {}
        """Compared buckets whose masters adopted an edit, counted on their device (no host read in the step)."""

    @property
    def flagged(self) -> int:
        """Buckets found edited so far: what tests and benchmarks read. Reads the device counts (a host read):
        never called by the step."""
        return self._found_here + sum(int(count.item()) for count in self._found_on.values())

    def watch(self, bucket: FlatBucket, digestible: bool = True, runs: list[MasterRun] | None = None) -> None:
        """The step writes ``bucket``'s shard from separate masters: ``runs``, fp32 masters on the shard's device
        (adopting edits by a masked copy); else masters elsewhere, the shard digested if ``digestible`` (device
        memory between steps, not held by a tier) or compared every step."""
        self.unwatch(bucket)
        if runs is not None:
            self._compared[id(bucket)] = runs
        elif digestible:
            self._watched[id(bucket)] = bucket
        else:
            self._always.add(id(bucket))

    def unwatch(self, bucket: FlatBucket) -> None:
        self._compared.pop(id(bucket), None)
        self._watched.pop(id(bucket), None)
        self._always.discard(id(bucket))
        self._digests.pop(id(bucket), None)

    def check(self) -> None:
        """Before a step: which digested shards were written since the step wrote them (one host read, if any
        shard is digested: only with tiers). Compared buckets need no decision: ``adopt`` is a masked copy."""
        reattached = {id(b) for b in self._resident if b.reattach()}
        self._edited = set(self._always)
        self._edited |= {key for key in self._watched if key in reattached or key not in self._digests}
        self._found_here += len(reattached & set(self._watched))
        recorded = [key for key in self._watched if key in self._digests and key not in reattached]
        if not recorded:
            return
        differs = [self._digest_differs(self._watched[key]) for key in recorded]
        flags = torch.stack([d.to(differs[0].device) for d in differs]).tolist()  # the one host read
        found = {key for key, changed in zip(recorded, flags, strict=True) if changed}
        self._found_here += len(found)
        self._edited |= found

    def _digest_differs(self, bucket: FlatBucket) -> Tensor:
        shard = bucket.param_shard
        return torch.ne(digest(shard, self._weights_on(shard.device)), self._digests[id(bucket)]).any()

    def edited(self, bucket: FlatBucket) -> bool:
        """During the step: whether ``bucket``'s masters must adopt edits of its shard. Always for a compared
        bucket: the adoption itself finds the edited elements, on the device."""
        return id(bucket) in self._edited or id(bucket) in self._compared

    def adopt(self, bucket: FlatBucket, runs: list[MasterRun]) -> None:
        """During the step, before ``bucket`` is stepped: its masters ``runs`` (on the shard's device) take the value
        of every parameter element edited since the step last wrote it; no host read."""
        if not runs or not self.edited(bucket):
            return
        adopted = adopt_edits(runs)
        if id(bucket) in self._compared:
            count = self._found_on.get(adopted.device)
            if count is None:
                count = self._found_on[adopted.device] = torch.zeros((), dtype=torch.int64, device=adopted.device)
            count.add_(adopted)

    def adopt_all(self) -> None:
        """``adopt`` for every compared bucket (the step in one piece)."""
        for runs in self._compared.values():
            self.adopt(runs[0].bucket, runs)

    def record(self, bucket: FlatBucket) -> None:
        """The step wrote ``bucket``'s shard (queued on its device's compute stream): digest what it wrote."""
        if id(bucket) in self._watched:
            shard = bucket.param_shard
            self._digests[id(bucket)] = digest(shard, self._weights_on(shard.device))
        self._edited.discard(id(bucket))

    def record_all(self) -> None:
        for bucket in self._watched.values():
            self.record(bucket)

    def _weights_on(self, device: torch.device) -> Tensor:
        if device not in self._weights:
            self._weights[device] = digest_weights(device)
        return self._weights[device]
