"""Functions run inside the ranks of ``tests/test_zeropp.py`` (``tests.harness.run_distributed``): ZeRO++'s
collectives on their own, and stage-3 training with each switch, metered by link."""

from __future__ import annotations

import os
import time
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from typing_extensions import override

from lightning_zero import ZeroConfig, ZeroOptimizer, ZeroStrategy
from lightning_zero.comm.collectives import all_gather, reduce_scatter
from lightning_zero.comm.hierarchical_reduce import HierarchicalReduceScatter
from lightning_zero.comm.ledger import CommLedger
from lightning_zero.comm.quantized_all_gather import quantized_all_gather
from lightning_zero.comm.topology import LINKS, NodeTopology, build_node_groups
from lightning_zero.models import GPTConfig, LitGPT
from lightning_zero.models.data import ByteCorpusDataModule
from lightning_zero.models.param_groups import param_groups_with_weight_decay
from lightning_zero.stage3.sharded_init import shard_module
from tests.parity import batch, build_model, build_optimizer, full_weights, loss_fn, native_collectives_on

RANKS_PER_NODE = 2
CORPUS = Path(__file__).resolve().parent.parent / "data" / "fables.txt"


def quantized_gather(shard: int, block: int) -> dict[str, torch.Tensor]:
    """Every rank's random shard, gathered exactly and quantized."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    mine = torch.randn(shard, generator=g) * (10.0**rank)
    exact = torch.empty(world * shard)
    all_gather(exact, mine, dist.group.WORLD).wait()
    quantized = torch.empty(world * shard)
    quantized_all_gather(quantized, mine, dist.group.WORLD, block).wait()
    return {"exact": exact, "quantized": quantized}


def hierarchical_reduce(shard: int, block: int, bits: int) -> dict[str, Any]:
    """This rank's input, its exact average shard and the hierarchical one, and the bytes each hop sent by link."""
    rank, world = dist.get_rank(), dist.get_world_size()
    nodes = build_node_groups(list(range(world)), RANKS_PER_NODE, timedelta(seconds=30), with_inter=True)
    assert nodes.inter is not None
    g = torch.Generator().manual_seed(100 + rank)
    data = torch.randn(world * shard, generator=g).to(torch.bfloat16)
    exact = torch.empty(shard, dtype=torch.bfloat16)
    reduce_scatter(exact, data.clone(), dist.group.WORLD).wait()
    exact32 = torch.empty(shard)
    reduce_scatter(exact32, data.float(), dist.group.WORLD).wait()
    ledger = CommLedger(topology=NodeTopology(world, RANKS_PER_NODE))
    hierarchical = torch.empty(shard, dtype=torch.bfloat16)
    comm = HierarchicalReduceScatter(nodes.intra, nodes.inter, bits, block)  # type: ignore[arg-type]
    ledger.record(comm(hierarchical, data, dist.group.WORLD)).wait()
    ledger.end_step()
    return {
        "input": data,
        "exact": exact32,
        "hierarchical": hierarchical,
        "intra": ledger.last_step_bytes("intra_node"),
        "inter": ledger.last_step_bytes("inter_node"),
    }


def train_metered(config: ZeroConfig, steps: int, native: bool = False) -> dict[str, Any]:
    """Stage-3 training of the parity GPT; per step the bytes sent by link, and those of the backward all-gathers."""
    with native_collectives_on() if native else nullcontext():
        rank = dist.get_rank()
        model = build_model("gpt")
        optimizer = build_optimizer("adamw", model)
        gatherer = shard_module(model, config, dist.group.WORLD, torch.device("cpu"))
        zero = ZeroOptimizer(model, optimizer, dist.group.WORLD, config, gatherer=gatherer)
        ledger = zero.ledger
        losses: list[float] = []
        backward_gathers: list[dict[str, int]] = []
        links: list[dict[str, dict[str, int]]] = []
        for step in range(steps):
            zero.zero_grad()
            loss = loss_fn("gpt", model, batch("gpt", rank, step, 0))
            before = dict(ledger.current_by_link)
            loss.backward()
            after = ledger.current_by_link
            backward_gathers.append(
                {
                    link: after.get((kind, link), 0) - before.get((kind, link), 0)
                    for (kind, link) in after
                    if kind.value == "all_gather"
                }
            )
            zero.step()
            losses.append(loss.item())
            links.append(
                {"intra_node": ledger.last_step_bytes("intra_node"), "inter_node": ledger.last_step_bytes("inter_node")}
            )
        return {
            "losses": losses,
            "weights": full_weights(model, zero),
            "backward_gathers": backward_gathers,
            "links": links,
            "total": ledger.last_step_bytes(),
            "shards": [b.param_shard.clone() for b in gatherer.all_buckets()],
        }


def _world_size() -> int:
    # A Trainer's teardown removes WORLD_SIZE from the environment; the process group outlives it.
    return dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])


class StepRecorder(pl.Callback):
    """Per optimizer step: the training loss, the bytes this rank sent by link, and the wall time and this process's
    CPU time (all its threads, gloo's included) since the last."""

    def __init__(self, progress_every: int | None = None) -> None:
        self.progress_every = progress_every
        self.losses: list[float] = []
        self.sent: list[dict[str, int]] = []
        self.seconds: list[float] = []
        self.cpu_seconds: list[float] = []
        self._last = time.perf_counter()
        self._last_cpu = time.process_time()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        now, cpu = time.perf_counter(), time.process_time()
        self.seconds.append(now - self._last)
        self.cpu_seconds.append(cpu - self._last_cpu)
        self._last, self._last_cpu = now, cpu
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))
        strategy = trainer.strategy
        assert isinstance(strategy, ZeroStrategy)
        by_link = {link: sum(strategy.communication_per_step(link).values()) for link in LINKS}
        self.sent.append({"all": sum(strategy.communication_per_step().values()), **by_link})
        steps = len(self.losses)
        if self.progress_every and trainer.is_global_zero and steps % self.progress_every == 0:
            print(f"step {steps}: loss {self.losses[-1]:.4f}, {self.seconds[-1]:.2f} s", flush=True)


class SgdGPT(LitGPT):
    """``LitGPT`` with SGD and momentum instead of AdamW: a uniform error in the gradients' scale, which Adam's
    normalization hides, changes SGD's steps."""

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(param_groups_with_weight_decay(self.gpt, 0.0), lr=self.lr, momentum=0.9)


OPTIMIZERS: dict[str, tuple[type[LitGPT], float]] = {"adamw": (LitGPT, 3e-3), "sgd": (SgdGPT, 0.1)}
"""The example GPT's module class and learning rate per optimizer."""


def fit_gpt(
    zero: dict[str, Any],
    steps: int,
    root: str,
    model: str = "small",
    progress_every: int | None = None,
    seed: int = 0,
    optimizer: str = "adamw",
    callbacks: list[pl.Callback] | None = None,
    lr: float | None = None,
) -> dict[str, Any]:
    """The example GPT on the shipped corpus, through the Trainer with stage 3 and ``zero``'s fields, bf16-mixed,
    on the ranks of ``run_distributed(..., init_process_group=False)``; every rank's per-step record. ``seed``
    sets the initial weights and the order of the batches; ``optimizer`` is a key of ``OPTIMIZERS``, ``lr`` overrides
    its learning rate."""
    pl.seed_everything(seed)
    config = GPTConfig.small() if model == "small" else GPTConfig.tiny(vocab_size=256, block_size=64)
    module, default_lr = OPTIMIZERS[optimizer]
    lit = module(config, lr=default_lr if lr is None else lr)
    data = ByteCorpusDataModule(path=CORPUS, seq_len=config.block_size, batch_size=8)
    recorder = StepRecorder(progress_every)
    trainer = _trainer(zero, steps, root, callbacks=[recorder, *(callbacks or [])])
    trainer.fit(lit, data)
    strategy = trainer.strategy
    assert isinstance(strategy, ZeroStrategy)
    return {
        "losses": recorder.losses,
        "sent": recorder.sent,
        "seconds": recorder.seconds,
        "cpu_seconds": recorder.cpu_seconds,
        "model_state": strategy.model_state_bytes()._asdict(),
    }


def fit_gpt_pair(zeros: list[dict[str, Any]], steps: int, root: str, model: str) -> list[dict[str, Any]]:
    """``fit_gpt`` for each of ``zeros`` in turn, in the same ranks (one process start for several runs)."""
    return [fit_gpt(zero, steps, root, model) for zero in zeros]


def _trainer(zero: dict[str, Any], steps: int, root: str, callbacks: list[pl.Callback] | None = None) -> pl.Trainer:
    return pl.Trainer(
        strategy=ZeroStrategy(stage=3, **zero),
        accelerator="cpu",
        devices=_world_size(),
        precision="bf16-mixed",
        max_steps=steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=root,
    )


def _exact_state(trainer: pl.Trainer) -> list[torch.Tensor]:
    """This rank's parameter shards and fp32 masters: what a checkpoint saves."""
    strategy = trainer.strategy
    assert isinstance(strategy, ZeroStrategy)
    assert strategy._gatherer is not None
    zero = strategy.optimizers[0]
    assert isinstance(zero, ZeroOptimizer)
    return [b.param_shard.clone() for b in strategy._gatherer.all_buckets()] + [m.clone() for m in zero.masters]


def checkpoint_into_plain(zero: dict[str, Any], root: str) -> tuple[list[torch.Tensor], list[torch.Tensor], float]:
    """Train 2 steps with ``zero``'s ZeRO++ switches and save; load that checkpoint into plain stage 3 and train on.
    Returns this rank's exact state as saved and as loaded, and the loss of the step after the load."""
    pl.seed_everything(0)
    config = GPTConfig.tiny(vocab_size=256, block_size=64)
    data = ByteCorpusDataModule(path=CORPUS, seq_len=config.block_size, batch_size=8)
    trainer = _trainer(zero, 2, root)
    trainer.fit(LitGPT(config, lr=3e-3), data)
    trainer.save_checkpoint(f"{root}/zeropp.ckpt")
    saved = _exact_state(trainer)
    plain = {"ranks_per_node": zero["ranks_per_node"]}
    loading = _trainer(plain, 2, root)  # already at step 2: fit only restores
    loading.fit(LitGPT(config, lr=3e-3), data, ckpt_path=f"{root}/zeropp.ckpt")
    loaded = _exact_state(loading)
    recorder = StepRecorder()
    resumed = _trainer(plain, 3, root)
    resumed.callbacks.append(recorder)  # type: ignore[attr-defined]
    resumed.fit(LitGPT(config, lr=3e-3), data, ckpt_path=f"{root}/zeropp.ckpt")
    return saved, loaded, recorder.losses[-1]


def gathered_under_qwz(config: ZeroConfig) -> dict[str, Any]:
    """One qwZ step, then ``gathered()`` read-only and with writeback of unchanged weights: what it hands out and
    what the shards hold afterwards, next to the shards' own (exact) values."""
    rank = dist.get_rank()
    model = build_model("gpt")
    optimizer = build_optimizer("adamw", model)
    gatherer = shard_module(model, config, dist.group.WORLD, torch.device("cpu"))
    zero = ZeroOptimizer(model, optimizer, dist.group.WORLD, config, gatherer=gatherer)
    loss_fn("gpt", model, batch("gpt", rank, 0, 0)).backward()
    zero.step()
    buckets = gatherer.all_buckets()
    shards = [b.param_shard.clone() for b in buckets]
    exact = [torch.cat(all_gathered(s)) for s in shards]
    with gatherer.gathered():
        seen = [b.data.clone() for b in buckets if b.data is not None]
    with gatherer.gathered(writeback=True):
        pass
    return {
        "seen": seen,
        "exact": [e[: b.padded_numel] for e, b in zip(exact, buckets, strict=True)],
        "before": shards,
        "after": [b.param_shard.clone() for b in buckets],
    }


def all_gathered(shard: torch.Tensor) -> list[torch.Tensor]:
    parts = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, shard)
    return parts
