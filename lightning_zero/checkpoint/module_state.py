"""A stage-3 model's own ``state_dict()`` and ``load_state_dict()``, true for code we did not write that calls them.

Note [a stage-3 model's state dict]
Outside its unit's gather a stage-3 parameter is a placeholder (Note [placeholders] in ``sharding/flat_bucket.py``);
code written for any strategy (LitGPT's ``save_lora_checkpoint``, Lightning's ``*_spawn`` launcher, peft,
``torch.distributed.checkpoint.state_dict``) reads and writes the model through ``state_dict()`` and
``load_state_dict()``, so both must tell the truth. What the peers do:

- FSDP2 keeps each parameter as a DTensor sharded on dim 0 (``Shard(0)``: rank r holds rows
  ``chunk(dim0, N)[r]``), so ``state_dict()`` returns DTensors, without communication; ``full_tensor()``,
  DCP and ``torch.distributed.checkpoint.state_dict.get_model_state_dict(full_state_dict=True, cpu_offload=True)``
  (rank 0 gets full CPU tensors one at a time) build on that. Its ``load_state_dict`` takes DTensors.
- FSDP1 returns full tensors by default (every rank gathers all of them), DeepSpeed stage 3 returns its empty
  placeholders unless the engine's ``_zero3_consolidated_16bit_state_dict`` is called.

Our shards are flat ranges of a bucket, which are no DTensor placement. ``state_dict()`` outside a gather therefore
gives FSDP2's contract by re-sharding at the call: bucket by bucket, every rank all-gathers the bucket's values, keeps
its ``Shard(0)`` rows of each parameter as the local tensor of a DTensor over a ``DeviceMesh`` of the model's process
group, and drops the gathered bucket. A rank holds its rows (about 1/N of the model) plus one bucket, and the values
are the run's exact ones: the fp32 masters where low-precision parameters keep them, as DDP's and FSDP2's
parameters are fp32 under mixed precision. ``state_dict()`` is collective, as FSDP1's is, and so are ``full_tensor()``
and the rest (LitGPT calls them on every rank). Then:

- inside ``gathered_parameters()`` (or a forward) the entries are copies of the gathered parameters, made where the
  state dict is taken, so they stay valid after the context releases the gather (views of the full buffers would
  point at storages resized to 0 bytes: files saved from them cannot be loaded and reading them crashes);
- ``full_state_dict()`` gives full tensors instead, optionally on the CPU and on rank 0 only (FSDP's
  ``FullStateDictConfig``): Lightning's ``*_spawn`` launcher takes it to hand the trained weights to the main process;
- ``state_dict(keep_vars=True)`` gives the parameters themselves, as torch defines it (the strategy's own
  checkpoints read the layout through it).

Note [load_state_dict into shards]
``load_state_dict`` is torch's own: the module's hooks (LitGPT's LoRA layers rename ``qkv.weight`` to
``qkv.linear.weight`` in ``_load_from_state_dict``, peft and Hugging Face register pre-hooks), its key handling,
``strict``, the shape checks and the returned ``_IncompatibleKeys`` all run unchanged. Only the copy into a sharded
parameter is redirected: a load pre-hook of each module that holds sharded parameters puts a stand-in in their
place, a tensor of the parameter's shape and dtype without memory (``_ShardWriter``), whose ``copy_`` (the call torch
makes with the source) writes this rank's range of the source into its shard and its fp32 master (the exact source
values in the master, their rounding in the shard, as the checkpoint loads do), and into the parameter itself where
it holds data (a resident bucket, a gathered unit). The parameter is put back as soon as it is written, and at the
module's post-hook for any key that was missing. So a lazily loaded tensor (Lightning's ``_NotYetLoadedTensor``) is
read only when torch copies it, one entry at a time, an mmap'd one pages in only the rows this rank owns, and memory
stays one source tensor; nothing is gathered, so no collective runs and a load on one rank is as a DDP load on one
rank. A DTensor source is made full first (``full_tensor()``, collective, as the ``state_dict()`` that made it).
``assign=True`` would replace the sharded parameters and is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils.hooks import RemovableHandle

from lightning_zero.checkpoint.slices import OwnedSlice, owned_parameter_slices
from lightning_zero.checkpoint.tiered import TierStorage, chunk_of
from lightning_zero.comm.collectives import all_gather
from lightning_zero.compat import disabled_torch_function_impl
from lightning_zero.sharding.flat_bucket import FlatBucket
from lightning_zero.sharding.sharded_optimizer import ZeroOptimizer
from lightning_zero.stage3.one_rank_calls import OneRankCalls
from lightning_zero.stage3.parameter_gatherer import ParameterGatherer

__all__ = ["ModuleState", "shard0_rows"]


def shard0_rows(rows: int, rank: int, world: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` of a tensor of ``rows`` rows that ``rank`` of ``world`` holds under ``Shard(0)``:
    ``torch.chunk``'s split, as DTensor makes it (the last ranks may hold none)."""
    size = -(-rows // world)
    start = min(rank * size, rows)
    return start, min(start + size, rows)


def _values_dtype(bucket: FlatBucket, mine: list[OwnedSlice]) -> torch.dtype:
    """What a bucket's values are gathered in: the fp32 masters' dtype where this rank's optimizers keep them."""
    return next((s.master_span.tensor.dtype for s in mine if s.own_master and s.master_span), bucket.dtype)


class _FullState(NamedTuple):
    """What ``state_dict()`` gives inside ``full_state_dict()``."""

    offload_to_cpu: bool
    rank0_only: bool


class _ShardWriter(Tensor):
    """Stands in for a sharded parameter while torch loads its module (Note [load_state_dict into shards]): the
    parameter's shape and dtype, no memory; ``copy_(source)`` hands the source to ``write``. Any other use is an
    error naming the parameter."""

    write: Callable[[Tensor], None]
    key: str

    @staticmethod
    def __new__(
        cls: type[_ShardWriter], param: nn.Parameter, name: str, write: Callable[[Tensor], None]
    ) -> _ShardWriter:
        made = Tensor._make_wrapper_subclass(cls, param.shape, dtype=param.dtype, device=param.device)
        made.write = write
        made.key = name
        return made

    __torch_function__ = disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        if func is torch.ops.aten.copy_.default and isinstance(args[0], _ShardWriter):
            args[0].write(args[1])
            return args[0]
        names = [a.key for a in args if isinstance(a, _ShardWriter)]
        raise RuntimeError(
            f"{func} on stage-3 parameter {names} while its module loads a state dict: only torch's copy of the "
            "source is supported there. HINT: a custom `_load_from_state_dict` should copy into the parameter with "
            "`param.copy_(source)`, or load after `with strategy.gathered_parameters(writeback=True):`."
        )


class ModuleState:
    """``state_dict()`` and ``load_state_dict()`` of one stage-3 model: the hooks that make them true (Note [a
    stage-3 model's state dict], Note [load_state_dict into shards]).

    ``optimizers`` and ``tiers`` give the strategy's current ``ZeroOptimizer``s (whose masters hold the exact values)
    and memory tiers at the time of the call."""

    def __init__(
        self,
        module: nn.Module,
        gatherer: ParameterGatherer,
        optimizers: Callable[[], Sequence[ZeroOptimizer]],
        tiers: Callable[[], TierStorage | None],
    ) -> None:
        self.module = module
        self.gatherer = gatherer
        self.calls: OneRankCalls | None = gatherer.calls
        self._optimizers = optimizers
        self._tiers = tiers
        self.buckets = gatherer.all_buckets()
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._position = {id(b): i for i, b in enumerate(self.buckets)}
        self._full: _FullState | None = None
        self._keep_vars: list[bool] = []
        """Per ``state_dict`` call in progress (pre-hook to post-hook), whether it keeps the variables."""
        self._values: dict[int, Tensor | None] = {}
        """By ``id(param)``: what the current ``state_dict`` call gives for it (None: nothing, on ranks > 0 under
        ``full_state_dict(rank0_only=True)``)."""
        self._mesh: DeviceMesh | None = None
        self._loading = 0
        """Load pre-hooks entered and not yet left: one ``load_state_dict`` is in progress while positive."""
        self._slices: dict[int, OwnedSlice] | None = None
        self._standing_in: dict[tuple[int, str], tuple[nn.Module, nn.Parameter]] = {}
        self._handles: list[RemovableHandle] = []
        for module_ in module.modules():
            if not any(p is not None and id(p) in self._bucket_of for p in module_._parameters.values()):
                continue
            self._handles += [
                module_.register_state_dict_pre_hook(self._state_dict_pre_hook),
                # torch marks the hook object, which a bound method cannot take: a partial can.
                module_.register_state_dict_post_hook(partial(ModuleState._state_dict_post_hook, self)),
                module_.register_load_state_dict_pre_hook(self._load_pre_hook),
                module_.register_load_state_dict_post_hook(self._load_post_hook),
            ]
        if self.calls is not None:
            self.calls.handlers["state"] = self._serve_values

    # -- state_dict -------------------------------------------------------------------------------------------------
    @contextmanager
    def full_state_dict(self, offload_to_cpu: bool = True, rank0_only: bool = False) -> Iterator[None]:
        """Inside the context ``state_dict()`` gives full tensors (Note [a stage-3 model's state dict]), on the CPU
        with ``offload_to_cpu``, and none on ranks other than 0 with ``rank0_only``; every rank calls it."""
        previous, self._full = self._full, _FullState(offload_to_cpu, rank0_only)
        try:
            yield
        finally:
            self._full = previous

    def _state_dict_pre_hook(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if not self._keep_vars and not keep_vars and self.calls is not None:
            self.calls.begin("state_dict()")  # Note [one-rank calls]
        self._keep_vars.append(keep_vars)

    def _state_dict_post_hook(
        self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
    ) -> None:
        keep_vars = self._keep_vars.pop()
        try:
            if not keep_vars:
                for name, param in module._parameters.items():
                    key = prefix + name
                    if param is None or id(param) not in self._bucket_of or key not in state_dict:
                        continue
                    value = self._value(param)
                    if value is None:
                        del state_dict[key]
                    else:
                        state_dict[key] = value
        finally:
            if not self._keep_vars:  # the outermost call is over
                self._values.clear()
                self._slices = None
                if not keep_vars and self.calls is not None:
                    self.calls.end()

    def _value(self, param: nn.Parameter) -> Tensor | None:
        bucket = self._bucket_of[id(param)]
        if not bucket.resident and bucket.data is not None:  # gathered: a copy that outlives the gather
            return param.detach().clone()
        if id(param) not in self._values:
            flat = self._gather_values(bucket)
            for slot, p in bucket.slots_and_params():
                self._values[id(p)] = self._entry(FlatBucket.param_view(flat, slot))
        return self._values[id(param)]

    def _gather_values(self, bucket: FlatBucket) -> Tensor:
        """The bucket's full flat values on every rank (collective): the fp32 masters where this rank's optimizers
        keep them, the parameters' own values elsewhere."""
        if self.calls is not None:
            self.calls.collective("state", self._position[id(bucket)])  # Note [one-rank calls]
        slices = self._owned()
        tiers = self._tiers()
        mine = [slices[id(p)] for p in bucket.params if slices[id(p)].stop > slices[id(p)].start]
        dtype = _values_dtype(bucket, mine)
        shard = torch.zeros(bucket.shard_numel, dtype=dtype, device=bucket.device)
        for s in mine:
            span = s.master_span if s.own_master and s.master_span is not None else s.values_span
            shard[s.shard_offset : s.shard_offset + s.stop - s.start].copy_(span.read(tiers))
        flat = torch.empty(bucket.padded_numel, dtype=dtype, device=bucket.device)
        all_gather(flat, shard, self.gatherer.group).wait()
        return flat

    @property
    def sharded(self) -> set[int]:
        """The ``id`` of every sharded parameter of the model."""
        return set(self._bucket_of)

    def bucket_of(self, param: nn.Parameter | Tensor) -> FlatBucket:
        return self._bucket_of[id(param)]

    def values_dtypes(self) -> dict[int, torch.dtype]:
        """By ``id`` of each sharded parameter: the dtype of its values in ``state_dict()`` (its fp32 master's where
        this rank's optimizers keep one)."""
        slices = owned_parameter_slices(self._optimizers(), self.gatherer)
        by_param = {id(s.param): s for s in slices}
        dtypes: dict[int, torch.dtype] = {}
        for bucket in self.buckets:
            mine = [by_param[id(p)] for p in bucket.params if by_param[id(p)].stop > by_param[id(p)].start]
            dtype = _values_dtype(bucket, mine)
            dtypes.update((id(p), dtype) for p in bucket.params)
        return dtypes

    def _serve_values(self, index: int) -> None:
        """A waiting rank's part in a lone caller's ``state_dict()`` (Note [one-rank calls])."""
        try:
            self._gather_values(self.buckets[index])
        finally:
            self._slices = None

    def _entry(self, full: Tensor) -> Tensor | None:
        group = self.gatherer.group
        if self._full is not None:
            if self._full.rank0_only and group.rank() != 0:
                return None
            return full.to("cpu", copy=True) if self._full.offload_to_cpu else full.clone()
        mesh = self.mesh(full.device)
        if full.dim() == 0:
            return DTensor.from_local(full.clone(), mesh, [Replicate()], run_check=False)
        stride = torch.empty(full.shape, device="meta").stride()
        return DTensor.from_local(
            self._rows(full).clone(), mesh, [Shard(0)], run_check=False, shape=full.shape, stride=stride
        )

    def _rows(self, full: Tensor) -> Tensor:
        """This rank's ``Shard(0)`` rows of ``full`` (a view; all of a 0-d tensor)."""
        if full.dim() == 0:
            return full
        start, stop = shard0_rows(full.shape[0], self.gatherer.group.rank(), self.gatherer.group.size())
        return full[start:stop]

    def mesh(self, device: torch.device) -> DeviceMesh:
        """The ``DeviceMesh`` of the model's process group that this model's DTensors live on."""
        if self._mesh is None:
            self._mesh = DeviceMesh.from_group(self.gatherer.group, device.type)
        return self._mesh

    def read_bucket(self, param: Tensor, rows: bool) -> tuple[Tensor, dict[int, Tensor]]:
        """The exact values of ``param``'s bucket (what ``state_dict()`` gives), gathered collectively: the flat
        bucket, and by ``id`` of each of its parameters its full values (views of it) or, with ``rows``, copies of
        this rank's ``Shard(0)`` rows (a DTensor's local tensor). A rank reading alone fails within seconds, naming
        the fix (Note [one-rank calls])."""
        bucket = self._bucket_of[id(param)]
        if self.calls is not None:
            self.calls.begin("a checkpoint hook reading a weight")
        try:
            flat = self._gather_values(bucket)
        finally:
            self._slices = None
            if self.calls is not None:
                self.calls.end()
        values = {}
        for slot, p in bucket.slots_and_params():
            full = FlatBucket.param_view(flat, slot)
            values[id(p)] = self._rows(full).clone() if rows else full
        return flat, values

    def _owned(self) -> dict[int, OwnedSlice]:
        """This rank's ranges of every parameter, computed once per ``state_dict``/``load_state_dict`` call."""
        if self._slices is None:
            slices = owned_parameter_slices(self._optimizers(), self.gatherer)
            self._slices = {id(s.param): s for s in slices}
        return self._slices

    # -- load_state_dict --------------------------------------------------------------------------------------------
    def _load_pre_hook(
        self,
        module: nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: Mapping[str, Any],
        *args: Any,
    ) -> None:
        if self._loading == 0:
            self._put_back()  # a load that raised half-way left stand-ins
            self._slices = None
        if local_metadata.get("assign_to_params_buffers"):
            self._loading = 0
            raise ValueError(
                "`load_state_dict(assign=True)` on a stage-3 model would replace its sharded parameters. HINT: load "
                "with `assign=False` (the default): the values are copied into the shards."
            )
        self._loading += 1
        for name, param in list(module._parameters.items()):
            if param is None or id(param) not in self._bucket_of:
                continue
            key = prefix + name
            if isinstance(state_dict.get(key), DTensor):  # a state dict of this model: make it full (collective)
                state_dict[key] = state_dict[key].full_tensor()
            write = partial(self._write, module, name, param)
            module._parameters[name] = _ShardWriter(param, key, write)  # type: ignore[assignment]
            self._standing_in[(id(module), name)] = (module, param)

    def _load_post_hook(self, module: nn.Module, incompatible_keys: Any) -> None:
        for name in list(module._parameters):
            entry = self._standing_in.pop((id(module), name), None)
            if entry is not None:
                module._parameters[name] = entry[1]
        self._loading -= 1
        if self._loading == 0:
            self._finish_load()

    def _write(self, module: nn.Module, name: str, param: nn.Parameter, source: Tensor) -> None:
        """Torch's copy of ``source`` into the stand-in of ``param`` (Note [load_state_dict into shards])."""
        self._standing_in.pop((id(module), name), None)
        module._parameters[name] = param
        bucket = self._bucket_of[id(param)]
        source = source.detach()
        s = self._owned()[id(param)]
        with torch.no_grad():
            if s.stop > s.start:
                values, master = s.values_span, s.master_span
                # The fp32 master takes the exact values and the low-precision shard their rounding; a master kept
                # apart in the same dtype (the host tier's) takes the parameter's (as LoadPlan does).
                target, mirror = (master, values) if s.own_master and master is not None else (values, master)
                chunk = chunk_of(target, s.start, s.shape, self._tiers(), mirror if s.separate_master else None)
                piece = chunk.destination(0, chunk.numel)
                piece.copy_(source.reshape(-1)[chunk.offset : chunk.offset + chunk.numel])
                chunk.commit(0, piece)
            if bucket.data is not None:  # full values live here too: a resident bucket, or a unit gathered now
                param.copy_(source)

    def _put_back(self) -> None:
        for (_, name), (module, param) in self._standing_in.items():
            module._parameters[name] = param
        self._standing_in.clear()

    def _finish_load(self) -> None:
        self._put_back()
        self._slices = None
        # Primary shards changed: no hpZ secondary shard made before may serve a gather (Note [secondary shards]).
        if any(u.gather_comm.secondary_bytes() for u in self.gatherer.units):
            self.gatherer.invalidate_secondaries()

    def bind(self, optimizers: Callable[[], Sequence[ZeroOptimizer]], tiers: Callable[[], TierStorage | None]) -> None:
        """Read the masters and tiers of another strategy from now on (a later Trainer took the model over)."""
        self._optimizers, self._tiers = optimizers, tiers

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
