"""What showing the reduced gradients as ``.grad`` costs a step (Note [gradients visible to hooks] in
``lightning_zero/engine/sharded_gradient.py``), for models of 200 and 2,000 parameter tensors, one process, stage 2:
the Trainer's ``VisibleGradients.show`` and ``hide`` around ``on_before_optimizer_step`` (paid only when the module or
a callback overrides the hook), and what Fabric's ``LoopGradients`` adds to every step (``show`` after a synchronizing
``fabric.backward``, the zeroing check, ``kept`` and ``hide`` around the step: Note [gradients between backward and
step]), beside torch's own ``module.zero_grad()`` over the same gradients, which every loop pays, in interleaved
rounds.

    .venv/bin/python benchmarks/visible_gradients.py
"""

from __future__ import annotations

import statistics
import tempfile
import time

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn

from lightning_zero import ZeroConfig, ZeroOptimizer
from lightning_zero.fabric.models import SetUpModel, SetUpModels
from lightning_zero.fabric.module import ZeroForwardModule
from lightning_zero.fabric.visible_gradients import LoopGradients
from lightning_zero.trainer.visible_gradients import VisibleGradients

ROUNDS = 200


class Layers(pl.LightningModule):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.net = nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)])

    def on_before_optimizer_step(self, optimizer: object) -> None:
        pass  # overridden: the gradients are shown


def main() -> None:
    dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
    for layers in (100, 1000):
        module = Layers(layers)
        optimizer = ZeroOptimizer(
            module, torch.optim.SGD(module.parameters(), lr=0.1), dist.group.WORLD, ZeroConfig(stage=2)
        )
        module.net(torch.randn(2, 8)).sum().backward()
        optimizer.reduce_gradients()
        visible = VisibleGradients()
        models = SetUpModels()
        models.models.append(SetUpModel(module, ZeroForwardModule(module), None, False, optimizers=[optimizer]))
        loop = LoopGradients(models)
        grads = [torch.zeros_like(p) for p in module.parameters()]
        times: dict[str, list[float]] = {"Trainer hooks": [], "Fabric loop": [], "module.zero_grad()": []}
        for round_ in range(ROUNDS + 3):  # the first three build the ShardedGradients (once per fit) and warm up
            start = time.perf_counter()
            visible.show(module, [optimizer])
            visible.hide()
            middle = time.perf_counter()
            loop.show()  # what a Fabric step adds: after the backward, then around the step
            loop.apply_zeroing(optimizer)
            with loop.kept():
                pass
            loop.hide(optimizer)
            end = time.perf_counter()
            for p, g in zip(module.parameters(), grads, strict=True):  # real gradients, set outside the timing
                p.grad = g
            begin = time.perf_counter()
            module.zero_grad()
            done = time.perf_counter()
            if round_ >= 3:
                times["Trainer hooks"].append(middle - start)
                times["Fabric loop"].append(end - middle)
                times["module.zero_grad()"].append(done - begin)
        tensors = 2 * layers
        reference = statistics.median(times["module.zero_grad()"])
        for name, rounds in times.items():  # medians: the machine is shared, a round may be preempted
            seconds = statistics.median(rounds)
            print(
                f"{tensors} parameter tensors, {name}: {seconds * 1e3:.2f} ms per step, "
                f"{seconds / tensors * 1e6:.2f} us each ({seconds / reference:.2f}x torch's zero_grad)"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
