"""The peak memory of one rank in a training step, predicted before any device memory is touched.

Note [predicted peak]
``predict_peak`` adds up, for one configuration (stage, precision, micro-batch, activation checkpointing, tiers,
world size):

- the model state the strategy's own layout puts on rank 0 (``layout.py``: parameters held, fp32 masters and the
  optimizer's state; the optimizer's bytes per element measured by stepping the user's optimizer on a small real
  tensor, ``profile_optimizer``), minus what the memory tiers move off the device (``model_state_by_tier``), and the
  module's buffers;
- one forward and backward of the user's own step on a fake copy of the model (Note [the step on fake tensors]),
  with the engine's gathers and gradient buckets replayed onto it (Note [engine memory replayed]): the largest sum
  of those at any moment, split by kind;
- the optimizer step that follows: the gradients the engine holds when backward ends and the temporaries the user's
  optimizer allocates for the largest call the engine makes (one bucket's shard, Note [step in chunks]), measured
  per element on the small real tensor.

The peak is the larger of the two phases, in a step after the first (the optimizer state exists then). Nothing
else of a run is counted: the allocator's caching and fragmentation (a GPU's ``max_memory_reserved`` above
``max_memory_allocated``), the CUDA context, libraries, the data loader's workers.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.config import ZeroConfig
from lightning_zero.planning.engine_replay import EngineReplay
from lightning_zero.planning.fake_step import (
    LiveBytes,
    PeakBytes,
    StepFn,
    fake_batch,
    fake_copy,
    fake_mode,
    logging_off,
    meta_copy,
    tensor_bytes,
)
from lightning_zero.planning.layout import Precisions, StageEstimate, layout_estimates
from lightning_zero.planning.model_state import ModelStateBytes, model_state_by_tier
from lightning_zero.sharding.activation_checkpointing import apply_activation_checkpointing_policy

PROFILE_NUMEL = 1 << 14
"""Elements of the real tensor the user's optimizer is stepped on to measure its state and temporaries."""


Phase = Literal["forward and backward", "optimizer step"]


class OptimizerProfile(NamedTuple):
    """What the user's optimizer allocates per element it steps (Note [predicted peak])."""

    state_bytes: float
    """Its state (Adam's two moments in the master dtype: 8 bytes in fp32)."""
    step_bytes: float
    """The temporaries one call of its step allocates beyond its inputs and state."""


class PeakPrediction(NamedTuple):
    """One configuration's predicted peak on one rank (rank 0, which holds the most: Note [estimate for rank 0])."""

    config: ZeroConfig
    world_size: int
    peak: PeakBytes
    """Device memory at the step's peak, by kind."""
    phase: Phase
    """Where the peak is."""
    host: int
    """Model state in the host tier (``offload_*="cpu"``), in host memory the whole step."""
    disk: int
    """Model state in the disk tier."""
    state: ModelStateBytes
    """The model state of the layout, wherever it lives."""
    sent: int
    """Bytes this rank sends per optimizer step."""

    @property
    def total(self) -> int:
        return self.peak.total


def profile_optimizer(optimizer: Optimizer, master_dtype: torch.dtype, foreach: bool | None) -> OptimizerProfile:
    """Step a fresh optimizer of ``optimizer``'s class and settings twice on a small real tensor and count its
    state and the temporaries of the second step. ``foreach``: the implementation the run's device gets (torch
    picks the multi-tensor one on GPUs only, so a prediction for a GPU asks for it on the host)."""
    param = nn.Parameter(torch.zeros(PROFILE_NUMEL, dtype=master_dtype))
    accepted = inspect.signature(type(optimizer).__init__).parameters
    settings = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    if foreach is not None and "foreach" in settings and settings["foreach"] is None:
        settings["foreach"] = foreach
    probe = type(optimizer)([param], **settings)
    param.grad = torch.full_like(param, 1e-3)
    probe.step()
    state = sum(v.numel() * v.element_size() for v in probe.state[param].values() if _per_element(v))
    live = LiveBytes(PeakBytes(0, 0, 0, 0, 0))
    live.exclude([param, param.grad, *(v for v in probe.state[param].values() if isinstance(v, Tensor))])
    with live:
        probe.step()
    return OptimizerProfile(state / PROFILE_NUMEL, live.peak.total / PROFILE_NUMEL)


def _per_element(value: Any) -> bool:
    return isinstance(value, Tensor) and value.dim() > 0


def predict_peak(
    module: nn.Module,
    make_optimizer: Callable[[nn.Module], Optimizer],
    step: StepFn,
    batch: Any,
    config: ZeroConfig,
    world_size: int,
    device: torch.device,
    param_dtype: torch.dtype,
    fp32_masters: bool,
    zero_grad_before_backward: bool = False,
) -> PeakPrediction:
    """Predict rank 0's peak in a training step of ``module`` under ``config`` (Note [predicted peak]).

    ``module``: the user's model, real or on meta; it is not changed (the prediction works on copies).
    ``make_optimizer``: builds the user's optimizer over a copy (``configure_optimizers``). ``step``: the forward
    of one micro-batch returning the loss, inside the run's precision context. ``batch``: one micro-batch (real or
    meta tensors; only shapes and dtypes are read). ``param_dtype``/``fp32_masters``: the precision's parameters
    and whether it keeps fp32 masters. ``zero_grad_before_backward``: the loop frees the previous step's gradients
    between the forward and the backward, as Lightning's automatic optimization does, so they are held through the
    forward; otherwise (``zero_grad()`` after the step, as Fabric loops write it) they are gone by then.
    """
    meta = meta_copy(module)
    apply_activation_checkpointing_policy(meta, config.activation_checkpointing_policy)
    mode = fake_mode()
    fake = fake_copy(meta, mode, device, param_dtype).train()  # a training step: dropout on, no KV cache
    optimizer = make_optimizer(meta)
    master_dtype = torch.float32 if fp32_masters else param_dtype
    profile = profile_optimizer(optimizer, master_dtype, True if device.type == "cuda" else None)
    param_bytes = torch.empty((), dtype=param_dtype).element_size()
    master_bytes = 4 if fp32_masters and param_bytes < 4 else 0
    precisions = Precisions(param_bytes, master_bytes, round(profile.state_bytes))
    estimate = layout_estimates(meta, optimizer, world_size, precisions, config)[config.stage]
    tiers = model_state_by_tier(
        estimate.state, config.stage, config.offload_optimizer, config.offload_params, config.offload_ratio
    )
    on_device = _on_device(estimate.state, config, tiers.device)
    buffers = sum(b.numel() * b.element_size() for b in meta.buffers())
    optimizer_bytes = on_device.master_weights + on_device.optimizer_state
    optimizer_bytes += _disk_io_bytes(estimate, config, precisions, tiers.disk)
    base = PeakBytes(on_device.parameters, 0, optimizer_bytes, 0, buffers)
    base = base._replace(activations=tensor_bytes(batch))

    live = LiveBytes(base)
    live.exclude([*fake.parameters(), *fake.buffers()])
    replay = EngineReplay(estimate, config, fake, live, world_size, param_bytes, device)
    pooled = replay.pooled_bytes()  # held between steps, so through both phases
    live.add("gradients", pooled)
    fakes = fake_batch(batch, mode, device)
    previous = replay.gradient_state_bytes() if zero_grad_before_backward else 0
    with mode, logging_off(fake), replay.installed(), live:
        live.add("gradients", previous)
        loss = step(fake, fakes)
        live.remove("gradients", previous)
        loss.backward()
        replay.finish_backward()
    backward_peak = live.peak
    held_grads = replay.reductions.held
    chunk = _largest_step_call(estimate, config)
    stepping = base._replace(gradients=held_grads + pooled)
    stepping = stepping._replace(optimizer_state=stepping.optimizer_state + round(profile.step_bytes * chunk))
    phase: Phase = "forward and backward" if backward_peak.total >= stepping.total else "optimizer step"
    peak = backward_peak if phase == "forward and backward" else stepping
    return PeakPrediction(config, world_size, peak, phase, tiers.host, tiers.disk, estimate.state, estimate.sent)


def _on_device(state: ModelStateBytes, config: ZeroConfig, device_total: int) -> ModelStateBytes:
    """The part of ``state`` the tiers leave on the device: parameters first (stage 3's shards move only with
    ``offload_params``), then masters and optimizer state in proportion."""
    params = state.parameters if config.offload_params == "none" else 0
    optimizer = max(device_total - params - state.gradients - state.secondary_shards, 0)
    both = state.master_weights + state.optimizer_state
    masters = optimizer * state.master_weights // both if both else 0
    return ModelStateBytes(params, 0, masters, optimizer - masters, state.secondary_shards)


DISK_IO_ENTRIES = 4
"""The disk tier's read-ahead and write-behind budgets, each in entries of the largest size
(``engine/tier_setup.py``)."""


def _disk_io_bytes(estimate: StageEstimate, config: ZeroConfig, p: Precisions, disk: int) -> int:
    """What the disk tier holds in memory at once: the entries it reads ahead and writes behind (Note [tier IO]), and
    the bucket being stepped (its masters, optimizer state and gradient shard); at most everything it holds."""
    if not config.offloads_to_disk:
        return 0
    buckets = [b for u in estimate.units for b in u.buckets] or list(estimate.bucket_sizes)
    if not buckets:
        return 0
    largest = max(b.shard_numel for b in buckets)
    entry = largest * max(p.param, 4 if p.master else p.param)  # a parameter shard, a master or one moment
    stepped = largest * (p.master + p.optimizer + p.param)
    return min(disk, 2 * DISK_IO_ENTRIES * entry + stepped)


def _largest_step_call(estimate: StageEstimate, config: ZeroConfig) -> int:
    """Elements of the largest group of masters one call of the user's optimizer steps (Note [step in chunks])."""
    buckets = [b for b in (*estimate.bucket_sizes, *(b for u in estimate.units for b in u.buckets)) if b.stepped]
    if not buckets:
        return 0
    if estimate.stage < 3 and not config.overlap_comm:
        return sum(b.shard_numel for b in buckets)
    return max(b.shard_numel for b in buckets)
