"""``fabric.save``/``fabric.load``/``fabric.load_raw`` under ZeRO: the Trainer's sharded directory format, so a
Fabric checkpoint resumes exactly in Fabric, loads into a Trainer and back, at another world size and stage."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from torch import Tensor, nn

from lightning_zero import CheckpointError, ZeroFabricStrategy, ZeroStrategy
from lightning_zero.checkpoint.slices import owned_parameter_slices
from lightning_zero.models.param_groups import param_groups_with_weight_decay
from tests.harness import run_distributed
from tests.test_checkpoint_trainer import Snapshot, TinyGPT, assert_same, full_state

BATCH, SEQ = 4, 16


class FabricTinyGPT(TinyGPT):
    """The Trainer tests' ``TinyGPT`` (tied embeddings, two param groups, a frozen parameter, a counting buffer) with
    a forward for a Fabric loop; its state dict is the Trainer's."""

    def forward(self, inputs: Tensor) -> Tensor:
        self.batches_seen += 1
        out: Tensor = self.model(inputs)
        return out


def _batch(rank: int, step: int) -> tuple[Tensor, Tensor]:
    tokens = torch.randint(0, 64, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1000 * rank + step))
    return tokens[:, :-1], tokens[:, 1:]


def _fabric(stage: int, devices: int) -> Fabric:
    strategy = ZeroFabricStrategy(stage=stage, bucket_numel=3_000)  # several buckets; parameters straddle ranks
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=devices)
    fabric.launch()
    return fabric


def _setup(fabric: Fabric) -> tuple[Any, Any]:
    raw = FabricTinyGPT()  # its own parameter and buffer have no initializer to rebuild them from meta
    model = fabric.setup_module(raw)
    optimizer = torch.optim.AdamW(param_groups_with_weight_decay(raw.model, 0.1), lr=3e-3)
    return model, fabric.setup_optimizers(optimizer)


def _steps(fabric: Fabric, model: Any, optimizer: Any, start: int, stop: int) -> list[float]:
    losses = []
    for step in range(start, stop):
        inputs, targets = _batch(fabric.global_rank, step)
        loss = nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _snapshot(fabric: Fabric, model: Any, optimizer: Any) -> dict[str, Any]:
    """The full state dict and this rank's optimizer-state slices, as ``tests.test_checkpoint_trainer`` takes them."""
    strategy = fabric.strategy
    assert isinstance(strategy, ZeroFabricStrategy)
    with strategy.gathered_parameters():
        full = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    state = []
    for s in owned_parameter_slices(strategy._optimizers, strategy._gatherer):
        if s.state_key is not None:
            for name, value in optimizer.state.get(s.state_key, {}).items():
                piece = value if value.dim() == 0 else value[s.state_offset : s.state_offset + s.stop - s.start]
                state.append((s.fqn, name, None if value.dim() == 0 else s.start, piece.clone()))
    return {"weights": full, "state": state, "lrs": [g["lr"] for g in optimizer.param_groups]}


def _assert_same_state(loaded: list[dict[str, Any]], saved: list[dict[str, Any]]) -> None:
    for snapshot in loaded:
        assert_same(snapshot["weights"], saved[0]["weights"])
        assert snapshot["lrs"] == saved[0]["lrs"]
    expected, actual = full_state(saved), full_state(loaded)
    assert actual.keys() == expected.keys()
    assert len(actual) > 0
    for key, value in expected.items():
        assert torch.equal(actual[key], value), key


# -- Fabric -> Fabric, exactly ---------------------------------------------------------------------------------------
def _resume(root: str, stage: int) -> dict[str, Any]:
    fabric = _fabric(stage, 2)
    model, optimizer = _setup(fabric)
    uninterrupted = _steps(fabric, model, optimizer, 0, 4)
    final = _snapshot(fabric, model, optimizer)

    fabric = _fabric(stage, 2)
    model, optimizer = _setup(fabric)
    _steps(fabric, model, optimizer, 0, 2)
    saved = _snapshot(fabric, model, optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3)
    scheduler.step()
    scheduler.step()  # not yet at step_size: the learning rates stay those of the uninterrupted run
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 2, "rng": torch.get_rng_state()}
    fabric.save(f"{root}/fabric.ckpt", state)

    fabric = _fabric(stage, 2)
    model, optimizer = _setup(fabric)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    remainder = fabric.load(f"{root}/fabric.ckpt", state)
    loaded = _snapshot(fabric, model, optimizer)
    resumed = _steps(fabric, model, optimizer, state["step"], 4)
    return {
        "losses": (uninterrupted, resumed),
        "final": (final, _snapshot(fabric, model, optimizer)),
        "saved": saved,
        "loaded": loaded,
        "remainder": sorted(remainder),
        "scheduler_steps": scheduler.last_epoch,
    }


def _load_elsewhere(root: str, stage: int, devices: int) -> dict[str, Any]:
    fabric = _fabric(stage, devices)
    model, optimizer = _setup(fabric)
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(f"{root}/fabric.ckpt", state, strict=False)
    assert state["step"] == 2
    return _snapshot(fabric, model, optimizer)


@pytest.mark.timeout(120)
def test_fabric_checkpoint_resumes_exactly_and_reshards_to_another_world_size_and_stage():
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(_resume, 2, root, 3, init_process_group=False)
        elsewhere = run_distributed(_load_elsewhere, 1, root, 2, 1, init_process_group=False)
    for result in results:
        uninterrupted, resumed = result["losses"]
        assert resumed == uninterrupted[2:]
        final, final_resumed = result["final"]
        assert_same(final_resumed["weights"], final["weights"])
        assert result["remainder"] == ["rng"]  # what the state did not ask for comes back
        assert result["scheduler_steps"] == 2  # a stateful object is restored with load_state_dict
    saved = [r["saved"] for r in results]
    _assert_same_state([r["loaded"] for r in results], saved)
    _assert_same_state(elsewhere, saved)  # 2 ranks at stage 3 -> 1 rank at stage 2


# -- Fabric -> Trainer -> Fabric, at another world size and stage ---------------------------------------------------
def _fabric_save(root: str) -> dict[str, Any]:
    fabric = _fabric(3, 2)
    model, optimizer = _setup(fabric)
    _steps(fabric, model, optimizer, 0, 3)
    fabric.save(f"{root}/fabric.ckpt", {"model": model, "optimizer": optimizer, "step": 3})
    return _snapshot(fabric, model, optimizer)


def _trainer_resume(root: str) -> dict[str, Any]:
    snapshot = Snapshot(at="start")

    class SaveAtStart(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
            trainer.save_checkpoint(f"{root}/trainer.ckpt")

    module = TinyGPT()
    trainer = pl.Trainer(
        strategy=ZeroStrategy(stage=2, bucket_numel=1_000),
        accelerator="cpu",
        devices=1,
        max_steps=2,
        callbacks=[snapshot, SaveAtStart()],
        enable_checkpointing=False,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, ckpt_path=f"{root}/fabric.ckpt")
    assert snapshot.taken is not None
    assert int(module.batches_seen) == 3 + 2  # the buffer came from the Fabric run
    return snapshot.taken


def _fabric_load_trainer_checkpoint(root: str) -> dict[str, Any]:
    fabric = _fabric(3, 2)
    model, optimizer = _setup(fabric)
    remainder = fabric.load(f"{root}/trainer.ckpt", {"model": model, "optimizer": optimizer})
    assert "global_step" in remainder  # the Trainer's own state comes back
    return _snapshot(fabric, model, optimizer)


@pytest.mark.timeout(150)
def test_fabric_checkpoint_resumes_a_trainer_and_a_trainer_checkpoint_loads_into_fabric():
    with tempfile.TemporaryDirectory() as root:
        saved = run_distributed(_fabric_save, 2, root, init_process_group=False)
        in_trainer = run_distributed(_trainer_resume, 1, root, init_process_group=False)
        back = run_distributed(_fabric_load_trainer_checkpoint, 2, root, init_process_group=False)
    _assert_same_state(in_trainer, saved)  # 2 ranks at stage 3 -> a Trainer on 1 rank at stage 2
    _assert_same_state(back, saved)  # -> Fabric on 2 ranks at stage 3 again


# -- load_raw, filter, refusals --------------------------------------------------------------------------------------
def _load_raw_and_filter(root: str) -> dict[str, Any]:
    fabric = _fabric(3, 2)
    model, optimizer = _setup(fabric)
    with fabric.strategy.gathered_parameters():  # type: ignore[attr-defined]
        expected = {k: v.detach().clone() + 1 for k, v in model.module.state_dict().items()}
    if fabric.global_rank == 0:
        torch.save(expected, f"{root}/full.pt")
    fabric.barrier()
    fabric.load_raw(f"{root}/full.pt", model)
    loaded = _snapshot(fabric, model, optimizer)["weights"]
    trainable = {k for k, p in model.module.named_parameters() if p.requires_grad}
    fabric.save(f"{root}/filtered.ckpt", {"model": model}, filter={"model": lambda k, v: v.requires_grad})
    refused = ""
    try:
        fabric.load(f"{root}/filtered.ckpt", {"model": model})
    except Exception as error:
        refused = str(error)
    fabric.load(f"{root}/filtered.ckpt", {"model": model}, strict=False)
    return {"expected": expected, "loaded": loaded, "trainable": trainable, "refused": refused}


@pytest.mark.timeout(120)
def test_load_raw_streams_a_full_state_dict_and_a_filtered_save_keeps_only_what_the_filter_keeps():
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(_load_raw_and_filter, 2, root, init_process_group=False)
        saved = torch.load(Path(root, "filtered.ckpt", "lightning_state.pt"), weights_only=True)
    for result in results:
        assert_same(result["loaded"], result["expected"])
        assert "frozen" not in result["trainable"]
        assert "frozen" in result["refused"]  # strict loading names what the filtered checkpoint lacks
    assert saved["fabric_names"]["models"] == {"model": ""}  # the one model, its own keys


def _load_corrupted(root: str) -> str:
    fabric = _fabric(2, 2)
    model, optimizer = _setup(fabric)
    fabric.save(f"{root}/ok.ckpt", {"model": model, "optimizer": optimizer})
    if fabric.global_rank == 0:
        shard = sorted(Path(root, "ok.ckpt").rglob("*.distcp"))[0]
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    fabric.barrier()
    try:
        fabric.load(f"{root}/ok.ckpt", {"model": model, "optimizer": optimizer})
    except CheckpointError as error:
        return str(error)
    return ""


@pytest.mark.timeout(120)
def test_a_corrupted_checkpoint_is_refused_as_the_trainer_refuses_it():
    with tempfile.TemporaryDirectory() as root:
        messages = run_distributed(_load_corrupted, 2, root, init_process_group=False)
    assert any(re.search(r"\.distcp is corrupted", m) for m in messages), messages


def _save_unloadable(root: str) -> dict[str, Any]:
    fabric = _fabric(3, 2)
    model, optimizer = _setup(fabric)
    refused = {}
    for name, entry in (("loader", torch.utils.data.DataLoader(torch.arange(8))), ("key", lambda: 0)):
        try:  # LitGPT's pretraining script saves its train_dataloader this way
            fabric.save(f"{root}/bad.ckpt", {"model": model, "optimizer": optimizer, name: entry})
        except CheckpointError as error:
            refused[name] = str(error)
    fabric.save(f"{root}/good.ckpt", {"model": model, "optimizer": optimizer, "step": 1})  # the ranks still agree
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(f"{root}/good.ckpt", state)
    return {"refused": refused, "bad": Path(root, "bad.ckpt").exists(), "step": state["step"]}


@pytest.mark.timeout(120)
def test_a_state_that_would_not_load_back_is_refused_on_every_rank_before_anything_is_written():
    """Note [a save that cannot load back]: a DataLoader in the saved state pickles but fails every resume; a lambda
    does not pickle, and failed on rank 0 alone after rank 1 had written its shards. Both are refused by name on
    every rank, nothing is written, and the next save and load work."""
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(_save_unloadable, 2, root, init_process_group=False)
    for result in results:
        assert result["refused"].keys() == {"loader", "key"}, result
        assert "'loader' (a DataLoader)" in result["refused"]["loader"]
        assert "'key' (a function)" in result["refused"]["key"]
        assert all("HINT: " in message for message in result["refused"].values())
        assert not result["bad"]
        assert result["step"] == 1
    assert results[0]["refused"] == results[1]["refused"]


# -- a one-file checkpoint of Fabric's DDP ----------------------------------------------------------------------------
def _ddp_file_into_zero(root: str) -> dict[str, Any]:
    fabric = Fabric(strategy="ddp", accelerator="cpu", devices=2)
    fabric.launch()
    model, optimizer = _setup(fabric)
    _steps(fabric, model, optimizer, 0, 2)
    with torch.no_grad():
        model.module.model.lm_head.weight.add_(1.0)  # weights no fresh build has (tied to the token embedding)
    expected = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    fabric.save(f"{root}/ddp.ckpt", {"model": model, "optimizer": optimizer, "step": 7})
    ddp_losses = _steps(fabric, model, optimizer, 2, 4)
    ddp_final = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    fabric = _fabric(3, 2)
    model, optimizer = _setup(fabric)
    refused = ""
    try:
        fabric.load(f"{root}/ddp.ckpt", {"model": model, "optimizer": optimizer, "scheduler": {}})
    except KeyError as error:
        refused = str(error)
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
    assert fabric.load(f"{root}/ddp.ckpt", state) == {}
    loaded = _snapshot(fabric, model, optimizer)["weights"]
    losses = _steps(fabric, model, optimizer, 2, 4)
    final = _snapshot(fabric, model, optimizer)["weights"]
    return {
        "loaded": loaded,
        "expected": expected,
        "step": state["step"],
        "refused": refused,
        "losses": (losses, ddp_losses),
        "final": (final, ddp_final),
    }


@pytest.mark.timeout(120)
def test_a_one_file_fabric_ddp_checkpoint_resumes_zero3_with_its_optimizer_state():
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(_ddp_file_into_zero, 2, root, init_process_group=False)
    for result in results:
        assert_same(result["loaded"], result["expected"])
        assert result["step"] == 7
        assert "scheduler" in result["refused"]  # strict loading, as Fabric's: a requested entry the file lacks
        losses, ddp_losses = result["losses"]  # Adam's moments came from DDP's file, mapped onto the shards
        torch.testing.assert_close(losses, ddp_losses, rtol=1e-5, atol=0)
        final, ddp_final = result["final"]
        assert_same(final, ddp_final, exact=False)
