"""Functions run inside the ranks of ``tests/test_hpz_secondaries.py``: stage 3 with hpZ on 4 ranks as 2 nodes x 2,
in the situations where a secondary shard outlives its unit's backward (Note [secondary shards]), against DDP's
arithmetic.

The model's root unit holds one element (``HpzNet.gain``), and so does each ``Scale`` unit: padded to 4, so ranks
1-3 hold only padding, which no optimizer step writes. A rule that judged a secondary shard by whether this rank's
primary shard was written would then decide differently on rank 0 than on the others.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroConfig, ZeroOptimizer, ZeroStrategy
from lightning_zero.stage3.parameter_gatherer import ParameterGatherer
from lightning_zero.stage3.sharded_init import shard_module

WORLD = 4
HPZ = {"stage": 3, "ranks_per_node": 2, "hpz_partition_size": 2, "wrap_module_classes": ("Block", "Scale", "Linear")}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.fc(x))


class Scale(nn.Module):
    """A unit of one element: only rank 0's shard holds a value."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((1,), 1.5))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight


class HpzNet(nn.Module):
    """``scenario`` picks how it runs: ``"reentrant"`` applies ``scale`` under reentrant activation checkpointing
    (its forward runs under no_grad, its gather with gradients happens in backward); ``"unreached"`` also runs
    ``side``, whose output the loss ignores (autograd never reaches it)."""

    def __init__(self, scenario: str) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.scenario = scenario
        self.gain = nn.Parameter(torch.ones(1))
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.scale = Scale()
        self.side = Scale()
        self.head = nn.Linear(8, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.blocks[0](x * self.gain)
        if self.scenario == "reentrant":
            h = torch.utils.checkpoint.checkpoint(self.scale, h, use_reentrant=True)
        else:
            h = self.scale(h)
        if self.scenario == "unreached":
            self.side(h)
        out: Tensor = self.head(self.blocks[1](h))
        return out


def _optimizers(model: HpzNet, two: bool) -> list[torch.optim.Optimizer]:
    """One AdamW, or two sharing the root unit (``gain`` in the first, ``head`` in the second), each stepped after a
    forward and backward of its own, as Lightning's manual optimization of a GAN does. Every backward reaches both
    optimizers' parameters: each one's gradients accumulate until its own step and ``zero_grad``, as torch's do."""
    if not two:
        return [torch.optim.AdamW(model.parameters(), lr=0.02)]
    first = [model.gain, *model.blocks[0].parameters(), model.scale.weight]
    second = [p for p in model.parameters() if all(p is not q for q in first)]
    return [torch.optim.AdamW(first, lr=0.02), torch.optim.AdamW(second, lr=0.01)]


def _loss(model: nn.Module, rank: int, step: int, phase: int) -> Tensor:
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + phase)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
    return nn.functional.mse_loss(model(x), y)


def reference(scenario: str, steps: int, two_optimizers: bool = False) -> dict[str, Any]:
    """DDP's arithmetic: each rank's gradients averaged over the ranks (a parameter no rank used keeps none)."""
    rank = dist.get_rank()
    model = HpzNet(scenario)
    optimizers = _optimizers(model, two_optimizers)
    losses = []
    for step in range(steps):
        for phase, optimizer in enumerate(optimizers):
            loss = _loss(model, rank, step, phase)
            loss.backward()
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad.div_(WORLD)
            optimizer.step()
            # This optimizer's only, as ZeroOptimizer's zero_grad (Note [gradients of several optimizers]): the
            # other one's gradients of this backward count in its next step, averaged again with the next backward's
            # (exact: the carried part is the same on every rank).
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
    return {"losses": losses, "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _gather_with_grad(gatherer: ParameterGatherer) -> None:
    """``gathered()`` between backward and the step, with gradients enabled (as in a Lightning hook)."""
    with torch.enable_grad(), gatherer.gathered():
        pass


def hpz(
    scenario: str, steps: int, two_optimizers: bool = False, config: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Stage 3 with hpZ on ``HpzNet``: ``scenario`` is one of HpzNet's, or ``"gathered"`` (``gathered()`` between
    backward and the step); ``config`` adds ZeroConfig fields."""
    rank = dist.get_rank()
    model = HpzNet(scenario)
    optimizers = _optimizers(model, two_optimizers)
    zero_config = ZeroConfig(**{**HPZ, "collective_timeout_s": 15.0, **(config or {})})
    gatherer = shard_module(model, zero_config, dist.group.WORLD, torch.device("cpu"))
    zeros = [ZeroOptimizer(model, o, dist.group.WORLD, zero_config, gatherer=gatherer) for o in optimizers]
    losses = []
    for step in range(steps):
        for phase, zero in enumerate(zeros):
            loss = _loss(model, rank, step, phase)
            loss.backward()
            if scenario == "gathered":
                _gather_with_grad(gatherer)
            zero.step()
            zero.zero_grad()
            losses.append(float(loss.detach()))
    with gatherer.gathered():
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "weights": weights}


def hpz_and_reference(
    scenario: str, steps: int, two_optimizers: bool = False, config: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    return [reference(scenario, steps, two_optimizers), hpz(scenario, steps, two_optimizers, config)]


def gan(hpz: bool) -> dict[str, Any]:
    """Lightning's GAN under manual optimization (two optimizers, each stepped after its own backward, the generator
    run forward with gradients for the discriminator's step and its output detached) on 4 ranks: DDP, or stage 3
    with hpZ over 2 nodes x 2."""
    from tests.test_lightning_features import make_trainer, summarize
    from tests.test_lightning_optimizers import LitGAN

    g = torch.Generator().manual_seed(7)
    real = TensorDataset(torch.randn(4 * 4 * 4, 6, generator=g) * 0.5 + 1.0)
    zero = {k: v for k, v in HPZ.items() if k != "wrap_module_classes"}
    strategy = ZeroStrategy(**zero, wrap_module_classes=("Linear",), collective_timeout_s=15.0) if hpz else None
    trainer = make_trainer(strategy or "ddp_find_unused_parameters_true", devices=WORLD, max_steps=8)
    module = LitGAN()
    trainer.fit(module, DataLoader(real, batch_size=4))
    return summarize(trainer, module)


def load_into_disk_tiers(root: str) -> list[dict[str, Any]]:
    """A GPT with every tier on disk: train step 0, save, train step 1, run one forward with gradients and no
    backward (its units' secondary shards hold step 1's weights), load the checkpoint of step 0, and train on step 2's
    batch. Plain stage 3 with the same tiers, trained on steps 0 and 2 only, is the reference (stage 3 with tiers
    gives DDP's numbers: ``tests/test_offload*.py``); hpZ gives plain stage 3's numbers bit for bit."""
    from tests import offload_checkpoint_runs as tiered

    results = []
    for name, config in (("plain", {}), ("hpz", {"ranks_per_node": 2, "hpz_partition_size": 2})):
        run = tiered.build(2, 64, f"{root}/{name}-tiers", seed=0, collective_timeout_s=15.0, **config)
        losses = tiered.train(run, 1)
        if name == "hpz":
            tiered.save(run, f"{root}/step0")
            tiered.train(run, 1, first=1)
            tokens = torch.randint(0, 512, (1, 17), generator=torch.Generator().manual_seed(1))
            run.model.loss(tokens[:, :-1], tokens[:, 1:])  # forward only: its secondaries outlive it
            tiered.load(run, f"{root}/step0")
        losses += tiered.train(run, 1, first=2)
        results.append({"losses": losses, "weights": tiered.full_weights(run)})
    return results


class InterNodeBytes(pl.Callback):
    """Per optimizer step, the bytes this rank sent to other nodes, by collective."""

    def __init__(self) -> None:
        self.steps: list[dict[str, int]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        assert isinstance(trainer.strategy, ZeroStrategy)
        self.steps.append(trainer.strategy.communication_per_step("inter_node"))


def host_tier_bytes(root: str) -> dict[str, list[dict[str, int]]]:
    """The example GPT through the Trainer (bf16-mixed) with its parameter shards in the host tier, on the tier's
    copy path (``FORCE_COPIES``: every gather copies the shard in, writing it): per step, the bytes sent to other
    nodes by collective, for plain stage 3, for hpZ, and for hpZ without the tier."""
    from tests import zeropp_runs
    from tests.offload_runs import forced_host_copies

    plain = {"ranks_per_node": 2, "collective_timeout_s": 15.0}
    hpz = {**plain, "hpz_partition_size": 2}
    runs = {"plain": {**plain, "offload_params": "cpu"}, "hpz": {**hpz, "offload_params": "cpu"}, "hpz_resident": hpz}
    sent: dict[str, list[dict[str, int]]] = {}
    with forced_host_copies():
        for name, zero in runs.items():
            recorder = InterNodeBytes()
            zeropp_runs.fit_gpt(zero, 3, root, "tiny", callbacks=[recorder])
            sent[name] = recorder.steps
    return sent


def subgroup(members: list[int], configs: list[dict[str, Any]]) -> dict[str, Any]:
    """6 ranks as 3 nodes x 2; ``members`` train the parity GPT as one ZeRO group, the other ranks take no part in it
    and never call into ZeRO. Per member, ``runs``: DDP over the group, then stage 3 with each of ``configs``' ZeRO++
    fields (a ValueError's message in place of a run that raised one). Then every rank creates a group of the whole
    world, as any later ``new_group`` must, and all-reduces its rank over it: ``world_sum``."""
    group = dist.new_group(members)  # every rank creates it (collective over the world)
    runs = _train_in(group, configs) if dist.get_rank() in members else None
    everyone = dist.new_group(list(range(dist.get_world_size())), timeout=timedelta(seconds=20))
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total, group=everyone)
    return {"runs": runs, "world_sum": float(total)}


def _train_in(group: dist.ProcessGroup, configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from tests.parity import batch, build_model, build_optimizer, loss_fn

    me = group.rank()

    def train(wrap: Callable[[nn.Module, torch.optim.Optimizer], tuple[nn.Module, Any]]) -> dict[str, Any]:
        model = build_model("gpt")
        forward, optimizer = wrap(model, build_optimizer("adamw", model))
        losses = []
        for step in range(3):
            optimizer.zero_grad()
            loss = loss_fn("gpt", forward, batch("gpt", me, step, 0))
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        gatherer = getattr(optimizer, "gatherer", None)
        with gatherer.gathered() if gatherer is not None else nullcontext():
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        return {"losses": losses, "weights": weights}

    def ddp(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, Any]:
        return DistributedDataParallel(model, process_group=group), optimizer

    def zero3(config: ZeroConfig) -> Callable[[nn.Module, torch.optim.Optimizer], tuple[nn.Module, Any]]:
        def wrap(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, Any]:
            gatherer = shard_module(model, config, group, torch.device("cpu"))
            return model, ZeroOptimizer(model, optimizer, group, config, gatherer=gatherer)

        return wrap

    results = [train(ddp)]
    for fields in configs:
        config = ZeroConfig(stage=3, ranks_per_node=2, collective_timeout_s=15.0, **fields)
        try:
            results.append(train(zero3(config)))
        except ValueError as error:
            results.append({"error": str(error)})
    return results
