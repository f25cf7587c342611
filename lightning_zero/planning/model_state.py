"""Model-state bytes per rank as named quantities: the paper's formula, and the split by memory tier.

They need no model and no process group, so ``planning`` (the estimates made before a run) and ``lightning.memory``
(the counts of a running model) share them.
"""

from __future__ import annotations

from typing import NamedTuple

from lightning_zero.offload.memory_tiers import TierBytes


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
