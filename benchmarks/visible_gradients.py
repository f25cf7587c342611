"""What showing the reduced gradients as ``.grad`` around ``on_before_optimizer_step`` costs a step (Note [gradients
visible to hooks] in ``lightning_zero/trainer/visible_gradients.py``): the time of ``VisibleGradients.show`` and
``hide`` for models of 200 and 2,000 parameter tensors, one process, stage 2, when the module overrides the hook
(without an override nothing runs). Paid only by runs whose module or callbacks override the hook.

    .venv/bin/python benchmarks/visible_gradients.py
"""

from __future__ import annotations

import tempfile
import time

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn

from lightning_zero import ZeroConfig, ZeroOptimizer
from lightning_zero.trainer.visible_gradients import VisibleGradients

ROUNDS = 50


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
        for _ in range(3):  # the first builds the ShardedGradients, once per fit
            visible.show(module, [optimizer])
            visible.hide()
        start = time.perf_counter()
        for _ in range(ROUNDS):
            visible.show(module, [optimizer])
            visible.hide()
        seconds = (time.perf_counter() - start) / ROUNDS
        tensors = 2 * layers
        print(f"{tensors} parameter tensors: {seconds * 1e3:.2f} ms per step, {seconds / tensors * 1e6:.2f} us each")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
