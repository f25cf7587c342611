"""Model-state memory per rank: what the sharded objects really hold, and what the ZeRO paper says they should.

``model_state_bytes`` counts the bytes of the tensors themselves (each storage once), not the process RSS, so it is
exact and free of allocator effects. ``expected_model_state_bytes`` is the paper's formula for the same quantity.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from torch import Tensor, nn

from lightning_zero.config import ZeroConfig
from lightning_zero.offload.memory_tiers import TierBytes, place_by_ratio
from lightning_zero.sharding.sharded_optimizer import ZeroOptimizer
from lightning_zero.stage3.parameter_gatherer import ParameterGatherer
from lightning_zero.stage3.zeropp import secondary_shard_bytes


class ModelStateBytes(NamedTuple):
    """Bytes of model state held by one rank."""

    parameters: int
    """Parameters as the module uses them (full for stages 1 and 2), including frozen ones."""
    gradients: int
    """Gradient storage kept between steps (full for stage 1, this rank's shard for stage 2)."""
    master_weights: int
    """fp32 master shards that are separate tensors (0 when parameters are fp32: they are their own master)."""
    optimizer_state: int
    """Optimizer state tensors (e.g. Adam's two moments) for this rank's shard."""
    secondary_shards: int = 0
    """ZeRO++ hpZ: the secondary shards a rank holds between the units' forward and the optimizer step, the sharded
    parameters / ``hpz_partition_size`` (Note [secondary shards] in ``stage3/secondary_shard.py``); 0 without hpZ."""

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.master_weights + self.optimizer_state + self.secondary_shards


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


def expected_model_state_bytes(
    num_params: int,
    world_size: int,
    stage: int,
    param_bytes: int = 2,
    master_bytes: int = 4,
    optimizer_state_bytes: int = 8,
    hpz_partition_size: int = 1,
) -> ModelStateBytes:
    """The ZeRO paper's per-rank model state for ``num_params`` (Ψ) parameters on ``world_size`` (N) ranks.

    With bf16 parameters and gradients (2 bytes) and Adam in fp32 (4 master + 8 moments: K = 12) this is 16Ψ for DDP
    (stage 0), 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N and 16Ψ/N for stages 1, 2 and 3. For fp32 training pass ``master_bytes=0``:
    the parameters are their own master weights. ZeRO++'s hpZ (stage 3, ``hpz_partition_size`` k > 1) adds
    secondary shards of 2Ψ/k.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"Invalid stage: {stage!r}. Expected 0 (DDP), 1, 2 or 3.")
    n = world_size
    psi = num_params
    params = psi * param_bytes // (n if stage >= 3 else 1)
    grads = psi * param_bytes // (n if stage >= 2 else 1)
    masters = psi * master_bytes // (n if stage >= 1 else 1)
    state = psi * optimizer_state_bytes // (n if stage >= 1 else 1)
    secondary = psi * param_bytes // hpz_partition_size if stage >= 3 and hpz_partition_size > 1 else 0
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


def model_state_by_tier(
    state: ModelStateBytes, stage: int, offload_optimizer: str, offload_params: str, ratio: float = 1.0
) -> TierBytes:
    """Where ``state`` (one rank's model state at ``stage``; 0 for DDP) lives between uses with these
    ``ZeroConfig.offload_*`` settings: the masters and optimizer state (``ratio`` of them) in the optimizer's tier,
    with stage 3's gradient shards when that tier is the disk (Note [gradients on disk]), and stage 3's parameter
    shards in the parameters' tier."""
    by_tier = {"none": 0, "cpu": 0, "disk": 0}
    if stage >= 1:
        optimizer = (state.master_weights + state.optimizer_state) * ratio
        if stage == 3 and offload_optimizer == "disk":
            optimizer += state.gradients * ratio
        by_tier[offload_optimizer] += int(optimizer)
    if stage == 3:
        by_tier[offload_params] += state.parameters
    return TierBytes(state.total - by_tier["cpu"] - by_tier["disk"], by_tier["cpu"], by_tier["disk"])
