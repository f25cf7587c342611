"""Runs for the memory-tier tests, inside ranks started by ``tests.harness.run_distributed``: a small GPT trained
through Lightning's Trainer under DDP and under ZeRO with tiers, recording the loss of every step."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor

from lightning_zero import ZeroConfig, ZeroOptimizer, ZeroStrategy, shard_module
from lightning_zero.models.gpt import GPT, GPTConfig
from lightning_zero.offload import host_copies
from lightning_zero.offload.directory import OffloadDirectory
from lightning_zero.offload.memory_tiers import MemoryTiers
from tests import memory_probe
from tests.test_checkpoint_trainer import TinyGPT, weights


class TierBytesAtEnd(pl.Callback):
    """The strategy's bytes per tier when training ends (before teardown brings the model back into memory), and
    the bytes the host tier copied between device and host buffers."""

    def __init__(self) -> None:
        self.tiers: tuple[int, ...] | None = None
        self.host_copies: tuple[int, int] = (0, 0)
        self.optimizer_state: dict[int, dict[str, Tensor]] = {}

    def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if isinstance(trainer.strategy, ZeroStrategy):
            self.tiers = tuple(trainer.strategy.tier_bytes())
            tiers = trainer.strategy.memory_tiers
            self.host_copies = tiers.host_copy_bytes() if tiers is not None else (0, 0)
            # What user code gets from the optimizer, also where the tiers hold the state.
            state = trainer.optimizers[0].state_dict()["state"]
            self.optimizer_state = {i: {k: v.clone() for k, v in s.items()} for i, s in state.items()}


class RecordingGPT(TinyGPT):
    def __init__(self, foreach: bool | None = None, fused: bool | None = None) -> None:
        super().__init__()
        self.losses: list[float] = []
        self.foreach = foreach
        self.fused = fused

    def configure_optimizers(self) -> Any:
        configured = super().configure_optimizers()
        for group in configured["optimizer"].param_groups:
            group["foreach"] = self.foreach  # None: torch's choice (the single-tensor loop on the CPU)
            if self.fused is not None:
                group["fused"] = self.fused
        return configured

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        self.losses.append(float(loss.detach()))
        return loss


def train(
    strategy: str | dict[str, Any],
    root: str,
    steps: int = 4,
    clip: float | None = None,
    accumulate: int = 1,
    ckpt_path: str | None = None,
    save_to: str | None = None,
    save_every: int | None = None,
    callbacks: list[pl.Callback] | None = None,
    precision: str | None = "32-true",
    foreach: bool | None = None,
    plugins: list[Any] | None = None,
    fused: bool | None = None,
) -> dict[str, Any]:
    """Train ``steps`` steps; ``strategy``: "ddp" or ``ZeroStrategy`` keywords. Returns losses, weights, what the
    tier directory holds after the run, the bytes per tier and the bytes the host tier copied."""
    module = RecordingGPT(foreach, fused)
    tier_bytes = TierBytesAtEnd()
    callbacks = [*(callbacks or []), tier_bytes]
    if save_to is not None:  # saved during fit, where the tiers hold the optimizer state
        every = save_every or steps
        callbacks.append(ModelCheckpoint(dirpath=save_to, every_n_train_steps=every, save_top_k=-1))
    trainer = pl.Trainer(
        callbacks=callbacks,
        strategy=strategy if isinstance(strategy, str) else ZeroStrategy(**strategy),
        accelerator="cpu",
        devices=2,
        max_steps=steps,
        gradient_clip_val=clip,
        accumulate_grad_batches=accumulate,
        enable_checkpointing=save_to is not None,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        precision=precision,  # type: ignore[arg-type]
        plugins=plugins,
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    offload = Path(root, "offload")
    mine = f"-rank{trainer.global_rank}-"  # this rank's; another rank may still be tearing down
    left = sorted(n for n in os.listdir(offload) if mine in n) if offload.exists() else []
    return {
        "losses": module.losses,
        "weights": weights(module),
        "left": left,
        "tiers": tier_bytes.tiers,
        "host_copies": tier_bytes.host_copies,
        "optimizer_state": tier_bytes.optimizer_state,
    }


def compare(root: str, variants: list[dict[str, Any]], clip: float | None, accumulate: int) -> list[dict[str, Any]]:
    """DDP, then every variant, on the same data and seed."""
    return [train("ddp", root, clip=clip, accumulate=accumulate)] + [
        train(v, root, clip=clip, accumulate=accumulate) for v in variants
    ]


def resume_across_tiers(root: str, first: dict[str, Any], second: dict[str, Any]) -> list[dict[str, Any]]:
    """``first`` trains 2 steps and saves; ``second`` resumes to step 4; a run of ``first`` straight to 4 steps."""
    train(first, root, steps=2, save_to=f"{root}/mid")
    resumed = train(second, root, steps=4, ckpt_path=f"{root}/mid/epoch=0-step=2.ckpt")
    straight = train(first, root, steps=4)
    return [straight, resumed]


def _tiered_peak(n_layer: int, offload_dir: str, steps: int) -> tuple[int, int]:
    """Build a GPT on meta straight into the disk tiers, train ``steps`` steps; (peak RSS above the RSS before the
    build, model-state bytes of this rank as stage 3 would hold them without tiers)."""

    group = dist.group.WORLD
    assert group is not None
    config = ZeroConfig(
        stage=3, max_inflight_buckets=1, offload_optimizer="disk", offload_params="disk", offload_dir=offload_dir
    )
    memory_probe.reset_peak()
    before = memory_probe.rss_bytes()
    torch.manual_seed(0)
    with torch.device("meta"):
        # A block is 3.1M parameters (12.6 MB in fp32): units dwarf allocator noise; batch 1 keeps activations small.
        model = GPT(GPTConfig.tiny(n_layer=n_layer, n_embd=512, n_head=8, vocab_size=512, block_size=32))
    numel = sum(p.numel() for p in model.parameters())
    tiers = MemoryTiers(config, OffloadDirectory(Path(offload_dir), dist.get_rank()), io_entries=4)
    try:
        gatherer = shard_module(model, config, group, torch.device("cpu"), tiers=tiers)
        adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
        optimizer = ZeroOptimizer(model, adamw, group, config, gatherer, tiers=tiers.for_optimizer())
        tokens = torch.randint(0, 512, (1, 17), generator=torch.Generator().manual_seed(0))
        for _ in range(steps):
            model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
            optimizer.clip_grad_norm_(1.0)
            optimizer.step()
            optimizer.zero_grad()
        peak = memory_probe.peak_rss_bytes() - before
    finally:
        tiers.close()
    return peak, 16 * numel // dist.get_world_size()


def tiered_peaks(offload_dir: str, depths: list[int], steps: int) -> list[tuple[int, int]]:
    memory_probe.return_freed_memory_to_the_kernel()
    _tiered_peak(1, offload_dir, 2)  # page in the code paths before measuring
    return [_tiered_peak(n_layer, offload_dir, steps) for n_layer in depths]


class LoadPretrained(pl.Callback):
    """Loads full weights into the (tiered) sharded model when training starts, and records what it then holds."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.loaded: dict[str, Tensor] | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_zero import load_full_state_dict

        load_full_state_dict(trainer.strategy, self.path)
        self.loaded = weights(pl_module)


def pretrained_into_tiers(root: str, strategy: dict[str, Any]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(the full weights saved, what the tiered model holds after loading them)."""
    torch.manual_seed(7)
    source = RecordingGPT()
    with torch.no_grad():
        for p in source.parameters():
            p.add_(torch.randn_like(p))  # different from the seeded initialization
    path = f"{root}/pretrained-{os.environ['RANK']}.pt"  # the same weights on every rank (same seed)
    torch.save(source.state_dict(), path)
    load = LoadPretrained(path)
    train(strategy, root, steps=1, callbacks=[load])
    assert load.loaded is not None
    return source.state_dict(), load.loaded


@contextmanager
def forced_host_copies() -> Iterator[None]:
    """The host tier's copy path on the CPU (Note [host tier data path]): separate host masters and gradients, and
    every copy a GPU would make."""
    host_copies.FORCE_COPIES = True
    try:
        yield
    finally:
        host_copies.FORCE_COPIES = False


def compare_with_host_copies(
    root: str, variants: list[dict[str, Any]], clip: float | None, accumulate: int
) -> list[dict[str, Any]]:
    with forced_host_copies():
        return compare(root, variants, clip, accumulate)


class EditWeights(pl.Callback):
    """Halves the token embedding before the second optimizer step: the edit must reach the masters (Note [edits
    reach the masters])."""

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step != 1 or self.done:
            return
        self.done = True
        assert isinstance(trainer.strategy, ZeroStrategy)
        with trainer.strategy.gathered_parameters(writeback=True), torch.no_grad():
            pl_module.model.wte.weight.mul_(0.5)

    done = False


def host_copies_in_bf16(root: str, strategy: dict[str, Any], clip: float) -> list[dict[str, Any]]:
    """bf16-mixed with the host tier in memory, then with its copy path (both with the multi-tensor AdamW), each
    with the same edit of the weights between steps."""
    kwargs: dict[str, Any] = {"clip": clip, "accumulate": 2, "precision": "bf16-mixed", "foreach": True}
    plain = train(strategy, root, callbacks=[EditWeights()], **kwargs)
    with forced_host_copies():
        copied = train(strategy, root, callbacks=[EditWeights()], **kwargs)
    return [plain, copied]


def resume_across_tiers_with_host_copies(
    root: str, first: dict[str, Any], second: dict[str, Any]
) -> list[dict[str, Any]]:
    with forced_host_copies():
        return resume_across_tiers(root, first, second)


DELAYED = {"stage": 2, "offload_optimizer": "cpu", "offload_overlap": "delayed", "offload_overlap_warmup": 2}


def delayed_update_runs(root: str, strategy: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """On the host tier's copy path: ``strategy`` exact and delayed (Note [delayed parameter update]), 6 steps; the
    delayed run saving at step 3 and going on; and a run resumed from that checkpoint."""
    delayed = {**strategy, **DELAYED}
    with forced_host_copies():
        return {
            "exact": train(strategy, root, steps=6, clip=0.05),
            "delayed": train(delayed, root, steps=6, clip=0.05),
            "saved": train(delayed, root, steps=6, clip=0.05, save_to=f"{root}/mid", save_every=3),
            "resumed": train(delayed, root, steps=6, clip=0.05, ckpt_path=f"{root}/mid/epoch=0-step=3.ckpt"),
        }
