"""Model-state memory per rank: what the sharded objects really hold, and what the ZeRO paper says they should.

``model_state_bytes`` counts the bytes of the tensors themselves (each storage once), not the process RSS, so it is
exact and free of allocator effects; ``tier_bytes`` splits it by memory tier, ``communication_per_step`` adds what a
step sent. ``expected_model_state_bytes`` (the paper's formula for the same quantity),
``ModelStateBytes`` and ``model_state_by_tier`` live in ``planning/model_state.py``, where the estimates use them
before any rank exists; they are imported here for the code that counts a running model.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor, nn

from lightning_zero.comm.topology import Link
from lightning_zero.config import ZeroConfig
from lightning_zero.offload.memory_tiers import MemoryTiers, TierBytes, place_by_ratio
from lightning_zero.planning.model_state import ModelStateBytes, expected_model_state_bytes, model_state_by_tier
from lightning_zero.sharding.sharded_optimizer import ZeroOptimizer
from lightning_zero.stage3.parameter_gatherer import ParameterGatherer
from lightning_zero.stage3.zeropp import secondary_shard_bytes


def _nbytes(tensors: Iterable[Tensor]) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def model_state_bytes(
    module: nn.Module, optimizers: Iterable[ZeroOptimizer], gatherer: ParameterGatherer | None = None
) -> ModelStateBytes:
    """This rank's model state. ``gatherer``: the stage-3 sharded model, whose parameters live in shards."""
    optimizers = list(optimizers)
    buckets = [b for opt in optimizers for b in opt.buckets]
    if gatherer is not None:
        buckets += gatherer.all_buckets()
    # A stage-3 parameter owns its shard; outside a forward the parameter itself is a one-element placeholder.
    sharded = {id(p) for b in buckets if not b.resident for p in b.params}
    held: list[Tensor] = [p for p in module.parameters() if id(p) not in sharded]
    for bucket in buckets:
        if not bucket.resident:
            held.append(bucket.param_shard)
        if bucket.data is not None:  # resident, or a stage-3 unit gathered right now
            held.append(bucket.data)
    params = _nbytes(held)
    reducers = {id(opt.reducer): opt.reducer for opt in optimizers}
    grads = sum(r.state_bytes() for r in reducers.values())
    masters = _nbytes(
        m
        for opt in optimizers
        for seg, m in zip(opt.segments, opt.masters, strict=True)
        if m.untyped_storage().data_ptr() != seg.bucket.param_shard.untyped_storage().data_ptr()
    )
    # Zero-dim entries (Adam's step counter) are bookkeeping, not per-parameter state.
    state = _nbytes(
        v
        for opt in optimizers
        for per_param in opt.state.values()
        for v in per_param.values()
        if isinstance(v, Tensor) and v.dim() > 0
    )
    secondary = 0 if gatherer is None else secondary_shard_bytes(gatherer, gatherer.config)
    return ModelStateBytes(params, grads, masters, state, secondary)


def host_tier_bytes(
    config: ZeroConfig, optimizers: Iterable[ZeroOptimizer], gatherer: ParameterGatherer | None = None
) -> int:
    """Bytes of this rank's model state placed in the host tier (``offload_*="cpu"``): masters and optimizer state
    of the buckets ``offload_ratio`` places there, and (stage 3) the parameter shards. On a CPU device this is the
    same memory as the device's (Note [host tier on this machine] in ``offload/optimizer_tiers.py``)."""
    total = 0
    if config.offload_optimizer == "cpu":
        for opt in optimizers:
            placed = place_by_ratio(opt.buckets, config.offload_ratio)
            for seg, master in zip(opt.segments, opt.masters, strict=True):
                if id(seg.bucket) not in placed:
                    continue
                own = master.untyped_storage().data_ptr() != seg.bucket.param_shard.untyped_storage().data_ptr()
                total += master.numel() * master.element_size() if own else 0
                if config.offload_optimizer_state == "disk":
                    continue  # the moments are in the tier file beside the host masters (Note [moments on disk])
                entries = opt.state.get(master, {}).values()
                total += sum(v.numel() * v.element_size() for v in entries if isinstance(v, Tensor) and v.dim() > 0)
    if config.offload_params == "cpu" and gatherer is not None:
        total += sum(
            b.param_shard.numel() * b.param_shard.element_size() for b in gatherer.all_buckets() if not b.resident
        )
    return total


def tier_bytes(
    config: ZeroConfig,
    module: nn.Module,
    optimizers: Iterable[ZeroOptimizer],
    gatherer: ParameterGatherer | None,
    tiers: MemoryTiers | None,
) -> TierBytes:
    """This rank's model state by memory tier: in device memory now, placed in the host tier, in the tier file on
    disk (``ZeroConfig.offload_*``)."""
    optimizers = list(optimizers)
    resident = model_state_bytes(module, optimizers, gatherer).total
    host = host_tier_bytes(config, optimizers, gatherer)
    disk = tiers.disk_bytes() if tiers is not None else 0
    stored = tiers.host_store_bytes() if tiers is not None else 0  # host tier, not held as tensors
    return TierBytes(resident - host + stored, host, disk)


def communication_per_step(optimizers: Iterable[ZeroOptimizer], link: Link | None = None) -> dict[str, int]:
    """Bytes this rank sent in the last optimizer step of each optimizer, per collective: in all, or with
    ``link="intra_node"`` / ``"inter_node"`` only those to ranks on its own node / on other nodes (Note [bytes by
    link] in ``comm/ledger.py``)."""
    total: dict[str, int] = {}
    ledgers = {id(o.ledger): o.ledger for o in optimizers}  # stage 3's optimizers share one
    for ledger in ledgers.values():
        for kind, nbytes in ledger.last_step_bytes(link).items():
            total[kind] = total.get(kind, 0) + nbytes
    return total


__all__ = [
    "ModelStateBytes",
    "communication_per_step",
    "expected_model_state_bytes",
    "host_tier_bytes",
    "model_state_by_tier",
    "model_state_bytes",
    "tier_bytes",
]
