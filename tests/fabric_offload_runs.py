"""Runs for ``tests/test_fabric_offload.py``, inside ranks started by ``tests.harness.run_distributed`` with
``init_process_group=False``: the same tiny GPT trained by a Trainer and by a Fabric loop on the same batches, with
the delayed parameter update (Note [delayed update in a Fabric loop]) or asynchronous saves (Note [asynchronous saves
in a Fabric loop])."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn

from lightning_zero import ZeroFabricStrategy, ZeroStrategy
from lightning_zero.cli.consolidate import consolidate_checkpoint
from lightning_zero.models.gpt import GPT, GPTConfig
from lightning_zero.offload.optimizer_tiers import OptimizerTiers
from tests.offload_runs import forced_host_copies

DELAYED: dict[str, Any] = {
    "offload_optimizer": "cpu",
    "offload_overlap": "delayed",
    "offload_overlap_warmup": 2,
    "bucket_numel": 3_000,
}
STEPS, SAVE_AT, CLIP = 6, 3, 0.05


class LossOf(nn.Module):
    """A tiny GPT whose forward returns the loss, so that the loss is computed inside the forward (and its autocast)
    under both front doors."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.gpt = GPT(GPTConfig.tiny(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16, bias=False))

    def forward(self, inputs: Tensor, targets: Tensor) -> Tensor:
        return self.gpt.loss(inputs, targets)


def batches(rank: int, count: int) -> list[tuple[Tensor, Tensor]]:
    tokens = torch.randint(0, 64, (count, 4, 17), generator=torch.Generator().manual_seed(99 + rank))
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


class Recording(pl.LightningModule):
    """``LossOf`` under the Trainer, on this rank's ``batches``, recording each step's loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = LossOf()
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        inputs, targets = self.rank_batches[batch_idx]
        loss = self.net(inputs, targets)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)

    def train_dataloader(self) -> Any:
        self.rank_batches = batches(self.global_rank, STEPS)
        return torch.utils.data.DataLoader(range(2 * STEPS), batch_size=1)  # indices only: the data is per rank


def trainer_run(root: str, fields: dict[str, Any], precision: str) -> dict[str, Any]:
    """``STEPS`` steps under the Trainer, clipped, saving after step ``SAVE_AT`` (the save settles the update in
    flight, as a Fabric save does)."""
    module = Recording()
    trainer = pl.Trainer(
        strategy=ZeroStrategy(**fields),
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        gradient_clip_val=CLIP,
        callbacks=[ModelCheckpoint(dirpath=f"{root}/trainer", every_n_train_steps=SAVE_AT, save_top_k=-1)],
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        precision=precision,  # type: ignore[arg-type]
    )
    trainer.fit(module)
    assert isinstance(trainer.strategy, ZeroStrategy)
    with trainer.strategy.gathered_parameters():
        weights = {n.removeprefix("net."): p.detach().float().clone() for n, p in module.named_parameters()}
    return {"losses": module.losses, "weights": weights}


def fabric_run(
    root: str,
    fields: dict[str, Any],
    precision: str,
    save_to: str | None = None,
    resume_from: str | None = None,
    teardown: bool = False,
) -> dict[str, Any]:
    """The Trainer's loop as a Fabric loop; ``save_to``: save after step ``SAVE_AT``; ``resume_from``: start from
    that checkpoint (its steps taken). Records which steps left an update in flight."""
    strategy = ZeroFabricStrategy(**fields)
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=2, precision=precision)  # type: ignore[arg-type]
    fabric.launch()
    model = fabric.setup_module(LossOf())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
    first = 0
    if resume_from is not None:
        state = {"model": model, "optimizer": optimizer, "step": 0}
        fabric.load(resume_from, state)
        first = state["step"]
    losses, in_flight = [], []
    for step, (inputs, targets) in enumerate(batches(fabric.global_rank, STEPS)[first:], start=first):
        loss = model(inputs, targets)
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=CLIP)  # waits for the update in flight
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
        tiers = optimizer.tiers
        assert isinstance(tiers, OptimizerTiers)
        in_flight.append(bool(tiers.in_flight()))
        if save_to is not None and step + 1 == SAVE_AT:
            fabric.save(save_to, {"model": model, "optimizer": optimizer, "step": step + 1})
    if teardown:  # the end of the run publishes the last update: Note [delayed update in a Fabric loop]
        strategy.teardown()
        assert not optimizer.tiers.in_flight()  # type: ignore[union-attr]
    with strategy.full_state_dict(offload_to_cpu=True):  # settles, where the update is still in flight
        full = model.state_dict()
    assert not optimizer.tiers.in_flight()  # type: ignore[union-attr]
    state = {n: full[n].float().clone() for n, _ in model.module.named_parameters()}  # the fp32 masters' values
    with strategy.gathered_parameters():  # the parameters themselves, as the Trainer's run reads them
        weights = {n: p.detach().float().clone() for n, p in model.module.named_parameters()}
    return {"losses": losses, "weights": weights, "state": state, "in_flight": in_flight}


def delayed_runs(root: str, stage: int, precision: str, one_file: bool = False) -> dict[str, dict[str, Any]]:
    """The Trainer's delayed run, the Fabric loop's saving after ``SAVE_AT`` steps, and a Fabric run resumed from that
    checkpoint; on the host tier's copy path (Note [host tier data path]). ``one_file``: ``state_dict_type="full"``."""
    fields = {**DELAYED, "stage": stage, **({"state_dict_type": "full"} if one_file else {})}
    checkpoint = f"{root}/fabric" + (".ckpt" if one_file else "")
    with forced_host_copies():
        return {
            "trainer": trainer_run(root, fields, precision),
            "fabric": fabric_run(root, fields, precision, save_to=checkpoint),
            "resumed": fabric_run(root, fields, precision, resume_from=checkpoint, teardown=True),
        }


# -- asynchronous saves ----------------------------------------------------------------------------------------------
def saving_run(root: str, stage: int, async_save: bool, kill_writer: bool = False) -> dict[str, Any]:
    """4 steps, saving after steps 2 and 4 to ``{root}/{async|sync}/step-N``; the weights after each step 2 (the
    first save's) and 4. ``kill_writer``: rank 0 kills the writer process once the first save is committed."""
    strategy = ZeroFabricStrategy(stage=stage, bucket_numel=3_000, async_save=async_save)
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=2)
    fabric.launch()
    model = fabric.setup_module(LossOf())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
    where = f"{root}/{'async' if async_save else 'sync'}"
    for step, (inputs, targets) in enumerate(batches(fabric.global_rank, 4), start=1):
        fabric.backward(model(inputs, targets))
        optimizer.step()
        optimizer.zero_grad()
        if step % 2 == 0:
            fabric.save(f"{where}/step-{step}", {"model": model, "optimizer": optimizer, "step": step})
        if kill_writer and step == 2:
            strategy.saves.wait()
            if fabric.global_rank == 0:
                (pid,) = writer_processes()
                os.kill(pid, signal.SIGKILL)
    strategy.teardown()  # waits for the last save: its error, if any, raised here
    return {"weights": _weights(strategy, model)}


def _weights(strategy: ZeroFabricStrategy, model: Any) -> dict[str, Tensor]:
    with strategy.gathered_parameters():
        return {n: p.detach().clone() for n, p in model.module.named_parameters()}


def resumed_run(root: str, stage: int, checkpoint: str) -> dict[str, Any]:
    """From ``checkpoint`` (saved after step 2), synchronously, to step 4."""
    strategy = ZeroFabricStrategy(stage=stage, bucket_numel=3_000)
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=2)
    fabric.launch()
    model = fabric.setup_module(LossOf())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(checkpoint, state)
    for inputs, targets in batches(fabric.global_rank, 4)[state["step"] :]:
        fabric.backward(model(inputs, targets))
        optimizer.step()
        optimizer.zero_grad()
    return {"weights": _weights(strategy, model), "step": state["step"]}


def async_save_runs(root: str, stage: int, with_sync: bool) -> dict[str, Any]:
    """The async saving run (and with ``with_sync`` the synchronous one), a synchronous run resumed from the async
    save of step 2, and (on rank 0) each checkpoint consolidated by the CLI's function."""
    kinds = ["async", "sync"] if with_sync else ["async"]
    runs = {kind: saving_run(root, stage, kind == "async") for kind in kinds}
    consolidated = {}
    if int(os.environ["RANK"]) == 0:
        for kind in kinds:
            for step in (2, 4):
                out = consolidate_checkpoint(f"{root}/{kind}/step-{step}", f"{root}/{kind}-{step}.pt")
                consolidated[f"{kind}-{step}"] = torch.load(out, weights_only=True)
    runs["resumed"] = resumed_run(root, stage, f"{root}/async/step-2")
    return {**runs, "consolidated": consolidated}


def lose_the_writer(root: str) -> None:
    saving_run(root, 2, True, kill_writer=True)


def writer_processes() -> list[int]:
    """This process's children running the checkpoint writer."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        parent = next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:"))
        if int(parent) == os.getpid() and b"write_worker" in command:
            found.append(int(pid))
    return found


EXIT_SCRIPT = """
import sys, time
import torch
from lightning.fabric import Fabric
from lightning_zero import ZeroFabricStrategy
from lightning_zero.checkpoint import async_save
from tests.fabric_offload_runs import LossOf, batches

write_save = async_save.write_save

def slow_write(*args, **kwargs):
    time.sleep(1)  # still writing when the script ends
    if sys.argv[2] == "fail":
        raise OSError("the disk is full")
    write_save(*args, **kwargs)

async_save.write_save = slow_write
fabric = Fabric(strategy=ZeroFabricStrategy(stage=2, async_save=True), accelerator="cpu", devices=1)
fabric.launch()
model = fabric.setup_module(LossOf())
optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
fabric.backward(model(*batches(0, 1)[0]))
optimizer.step()
fabric.save(sys.argv[1], {"model": model, "optimizer": optimizer})
print("saved", flush=True)
"""
"""A one-process Fabric script whose last save is still being written when it ends without a teardown: argv is
(checkpoint directory, "ok" or "fail")."""
