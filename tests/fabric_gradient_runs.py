"""A Fabric loop that reads gradients between ``fabric.backward`` and the step, as loops log them (a norm per tensor,
Lightning's ``grad_norm``, ``torch.nn.utils.get_total_norm`` over ``p.grad is not None``, a copy), run under Fabric's
DDP (the oracle) and ``Fabric(strategy="zero*")`` (Note [gradients between backward and step]). Runs inside ranks
started by ``tests.harness.run_distributed`` with ``init_process_group=False``."""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric import Fabric
from lightning.pytorch.utilities import grad_norm
from torch import Tensor, nn

from tests.lightning_port_fabric_runs import STRATEGIES, batch, loss_of, make_fabric, weights

Reads = dict[str, Any]


def build() -> nn.Module:
    """Two Linear layers, the first one's bias frozen: its ``.grad`` stays None under every strategy."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    model[0].bias.requires_grad_(False)
    return model


def reads(model: Any) -> Reads:
    """What a loop reads from ``.grad`` after ``fabric.backward``, every rank in the same order."""
    named = list(model.named_parameters())
    shown = [p.grad for _, p in named if p.grad is not None]
    return {
        "has_grad": {n: p.grad is not None for n, p in named},
        "norms": {n: torch.linalg.vector_norm(p.grad) for n, p in named if p.grad is not None},
        "inf_norms": {n: p.grad.norm(float("inf")) for n, p in named if p.grad is not None},
        "grad_norm": grad_norm(model, norm_type=2),  # Lightning's own, unchanged
        "total": torch.nn.utils.get_total_norm(shown),  # torch._foreach_norm over every gradient at once
        "values": {n: p.grad.clone() for n, p in named if p.grad is not None},
    }


def _refusal(call: Any) -> str | None:
    try:
        call()
    except RuntimeError as error:
        return str(error)
    return None


def loop(name: str, precision: str, **fields: Any) -> dict[str, Any]:
    """Five steps read as a loop reads them: one backward; two backward passes into the same gradients (the Fabric DCGAN
    example's discriminator); accumulation under ``no_backward_sync``; gradients discarded by
    ``model.zero_grad(set_to_none=False)``; a second model's read before its backward, after the first one's were
    clipped. ZeRO only: a write, and a backward into gradients already read, refused."""
    fabric: Fabric = make_fabric(name, precision, **({} if name == "ddp" else fields))
    module = build()
    model, optimizer = fabric.setup(
        module, torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=0.1)
    )
    rank = fabric.global_rank
    zero = name != "ddp"
    result: dict[str, Any] = {}

    fabric.backward(loss_of(model, batch(rank, 0)))
    result["one_backward"] = reads(model)
    if zero:
        result["write"] = _refusal(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1))
        result["scale"] = _refusal(lambda: model.module[2].weight.grad.mul_(0.5))
    optimizer.step()
    optimizer.zero_grad()
    result["after_step"] = {n: p.grad is None for n, p in model.named_parameters()}

    fabric.backward(loss_of(model, batch(rank, 8)))
    torch.linalg.vector_norm(model.module[0].weight.grad)  # a read: the reduction is finished
    if zero:  # its gradients, and the refused backward's, are dropped
        result["backward_after_read"] = _refusal(lambda: fabric.backward(loss_of(model, batch(rank, 9))))
    optimizer.zero_grad()

    fabric.backward(loss_of(model, batch(rank, 1)))
    fabric.backward(loss_of(model, batch(rank, 2)))
    result["two_backward"] = reads(model)
    optimizer.step()
    optimizer.zero_grad()

    with fabric.no_backward_sync(model):
        fabric.backward(loss_of(model, batch(rank, 3)))
        accumulating: dict[str, Tensor | str | None] = {}
        for n, p in model.named_parameters():
            accumulating[n] = None if p.grad is None else _refusal(lambda g=p.grad: g.clone()) or p.grad.clone()
        result["accumulating"] = accumulating
    fabric.backward(loss_of(model, batch(rank, 4)))
    result["accumulated"] = reads(model)
    optimizer.step()
    optimizer.zero_grad()

    fabric.backward(loss_of(model, batch(rank, 5)))
    model.zero_grad(set_to_none=False)  # zeros, which SGD without momentum does not move
    result["zeroed"] = reads(model)
    optimizer.step()
    optimizer.zero_grad()

    # A second model, read after a backward that did not reach it (a GAN's generator after the discriminator's): no
    # gradient anywhere, then its own backward adds to nothing lost.
    generator = build()
    generator, generator_optimizer = fabric.setup(generator, torch.optim.SGD(generator.parameters(), lr=0.1))
    fabric.backward(loss_of(model, batch(rank, 6)))
    result["unreached"] = [torch.linalg.vector_norm(p.grad) for p in generator.parameters() if p.grad is not None]
    fabric.clip_gradients(model, optimizer, max_norm=100.0)  # reduced, then a backward that does not reach them
    fabric.backward(loss_of(generator, batch(rank, 7)))
    result["reached"] = reads(generator)
    for each in (optimizer, generator_optimizer):
        each.step()
        each.zero_grad()
    result["weights"] = weights(fabric, model, generator)
    return result


def battery(precision: str, overlap_comm: bool) -> dict[str, dict[str, Any]]:
    """Every strategy; ``overlap_comm=False``: stage 1 reduces at the step, its ``.grad`` views kept until then."""
    return {name: loop(name, precision, overlap_comm=overlap_comm) for name in STRATEGIES}
