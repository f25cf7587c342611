"""Gradient clipping over shards: what ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` compute on the full
gradients of a DDP model, from each rank's reduced gradient shard.

Clipping by value is element-wise, so each rank clamps its shard and nothing is communicated. Clipping by norm needs
the norm of the whole gradient: each rank computes the partial norm of its shard (plus the partial norms of the
shards a memory tier holds, ``offload/tiered_grad_reducer.py``), one all-reduce combines them, and every rank scales
its shard by the same coefficient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero.comm.collectives import ProcessGroup, all_reduce_sum
from lightning_zero.comm.ledger import CommLedger


def check_clip_value(value: float, by: str) -> None:
    """Refuse a clip value that is not > 0 (also NaN, which would turn every gradient into NaN)."""
    if not value > 0:
        method = "clip_grad_norm_" if by == "norm" else "clip_grad_value_"
        raise ValueError(
            f"Invalid gradient clip value {value!r} for clipping by {by}. Expected > 0. HINT: to train without "
            f"clipping, do not call {method}."
        )


def total_norm(
    grads: list[Tensor],
    norm_type: float,
    group: ProcessGroup,
    ledger: CommLedger,
    device: torch.device,
    partial_norms: list[Tensor] | None = None,
) -> Tensor:
    """The ``norm_type`` norm of the gradient over every rank's ``grads`` (and ``partial_norms``: norms of further
    pieces of this rank's shard), as an fp32 scalar, equal on every rank."""
    partial_norms = partial_norms or []
    if norm_type == float("inf"):
        maxima = [g.abs().max() for g in grads] + partial_norms
        local = torch.stack(maxima).max() if maxima else torch.zeros((), device=device)
        total = local.float().reshape(1)
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
    else:
        # fp32 partial norms: bf16 ones (bf16-true) would round per segment, so the total, and then the clip
        # coefficient, would depend on how the shards happen to be cut (stage 3 cuts them per unit).
        norms = list(torch._foreach_norm(grads, norm_type, dtype=torch.float32)) if grads else []
        norms += partial_norms
        local = torch.stack([n.double() ** norm_type for n in norms]).sum() if norms else torch.zeros(())
        total = local.to(device=device, dtype=torch.float64).reshape(1)
        ledger.record(all_reduce_sum(total, group)).wait()
        total = total ** (1.0 / norm_type)
    return total.reshape(()).float()


def clip_coefficient(norm: Tensor, max_norm: float) -> Tensor:
    """As torch: min(1, max_norm / (norm + 1e-6)); applied also when it is 1, for identical rounding."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def scale_(grads: list[Tensor], coefficient: Tensor) -> None:
    if grads:
        torch._foreach_mul_(grads, coefficient.to(grads[0].dtype))


def clamp_(grads: list[Tensor], clip_value: float) -> None:
    if grads:
        torch._foreach_clamp_min_(grads, -clip_value)
        torch._foreach_clamp_max_(grads, clip_value)
