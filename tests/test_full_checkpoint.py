"""``ZeroConfig.state_dict_type="full"``: ``ModelCheckpoint`` under ZeRO writes one Lightning ``.ckpt`` file as a DDP
run writes it, gathered from the shards bucket by bucket; plain ``torch.load(weights_only=True)`` reads it, a DDP
Trainer resumes from it with ZeRO's exact weights and optimizer state and goes on as the ZeRO run does.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero import ZeroFabricStrategy, ZeroStrategy
from lightning_zero.checkpoint.files import CheckpointError
from lightning_zero.checkpoint.full_save import save_full_checkpoint
from tests.harness import run_distributed
from tests.test_checkpoint_files import Settings
from tests.test_checkpoint_trainer import Snapshot, TinyGPT, assert_same, assert_same_training_state, fit, weights


def _full_checkpoint_into_ddp(root: str, stage: int) -> tuple[Any, ...]:
    at_save = Snapshot(at="save")
    saves = ModelCheckpoint(dirpath=f"{root}/full", every_n_train_steps=2, save_top_k=-1)
    weights_only = ModelCheckpoint(dirpath=f"{root}/weights", every_n_train_steps=4, save_weights_only=True)
    strategy = ZeroStrategy(stage=stage, bucket_numel=3_000, state_dict_type="full")  # straddling ranks
    zero_run = weights(fit(strategy, 2, 4, root, callbacks=[at_save, saves, weights_only]))
    at_load = Snapshot(at="start")
    ddp_run = weights(fit("ddp", 2, 4, root, ckpt=f"{root}/full/epoch=0-step=2.ckpt", callbacks=[at_load]))
    return at_save.taken, at_load.taken, zero_run, ddp_run


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_full_checkpoint_written_under_zero_resumes_ddp_and_loads_with_plain_torch_load(stage):
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(_full_checkpoint_into_ddp, 2, root, stage, init_process_group=False)
        # DDP starts from ZeRO's exact weights, optimizer state, step and learning rates, and trains on alike.
        assert_same_training_state([r[1] for r in results], [r[0] for r in results])
        zero_final, ddp_final = results[0][2], results[0][3]
        assert_same(ddp_final, zero_final, exact=False)

        path = Path(root, "full", "epoch=0-step=4.ckpt")
        assert path.is_file()
        plain = torch.load(path, weights_only=True)
        assert plain["global_step"] == 4
        assert_same(plain["state_dict"], zero_final)
        assert (
            plain["state_dict"]["model.lm_head.weight"].data_ptr() == plain["state_dict"]["model.wte.weight"].data_ptr()
        )
        (adam,) = plain["optimizer_states"]
        assert [len(g["params"]) for g in adam["param_groups"]] == [
            len(g["params"]) for g in TinyGPT().configure_optimizers()["optimizer"].param_groups
        ]
        assert {n for entry in adam["state"].values() for n in entry} == {"step", "exp_avg", "exp_avg_sq"}
        plain_weights = torch.load(Path(root, "weights", "epoch=0-step=4.ckpt"), weights_only=True)
        assert "optimizer_states" not in plain_weights
        assert_same(plain_weights["state_dict"], zero_final)
        assert not list(Path(root, "full").glob(".*"))  # committed: no staged leftovers


def _from_disk_tiers(root: str) -> tuple[Any, ...]:
    saves = ModelCheckpoint(dirpath=f"{root}/full", every_n_train_steps=2, save_top_k=-1)
    tiers = {"offload_optimizer": "disk", "offload_params": "disk", "offload_dir": "tiers"}  # under default_root_dir
    strategy = ZeroStrategy(stage=3, bucket_numel=3_000, state_dict_type="full", **tiers)
    zero_run = weights(fit(strategy, 2, 4, root, callbacks=[saves]))
    ddp_run = weights(fit("ddp", 2, 4, root, ckpt=f"{root}/full/epoch=0-step=2.ckpt"))
    return zero_run, ddp_run


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_full_checkpoint_streams_shards_and_optimizer_state_from_disk_tiers():
    with tempfile.TemporaryDirectory() as root:
        zero_final, ddp_final = run_distributed(_from_disk_tiers, 2, root, init_process_group=False)[0]
        assert_same(ddp_final, zero_final, exact=False)  # weights and Adam state came out of the tiers whole
        assert_same(torch.load(Path(root, "full", "epoch=0-step=4.ckpt"), weights_only=True)["state_dict"], zero_final)


def test_full_checkpoint_refuses_a_remote_path():
    with pytest.raises(CheckpointError, match=r"state_dict_type='full' writes local files.*HINT"):
        save_full_checkpoint({"state_dict": {}}, "memory://bucket/x.ckpt", torch.nn.Linear(1, 1), [], None)


def test_full_checkpoints_to_a_remote_directory_are_refused_when_fit_starts(tmp_path):
    checkpoints = ModelCheckpoint(dirpath="memory://bucket/run")
    trainer = pl.Trainer(
        strategy=ZeroStrategy(stage=2, state_dict_type="full"),
        accelerator="cpu",
        devices=1,
        max_steps=1,
        callbacks=[checkpoints],
        logger=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    with pytest.raises(ValueError, match=r"state_dict_type='full' writes local files.*memory://bucket/run.*HINT"):
        trainer.fit(TinyGPT())


@pytest.mark.parametrize(
    ("entry", "named"),
    [(torch.utils.data.DataLoader(torch.arange(4)), "'loader' (a DataLoader)"), (lambda: 0, "'loader' (a function)")],
)
def test_a_state_that_would_not_load_back_is_refused_before_the_full_file_is_written(entry, named, tmp_path):
    """Note [a save that cannot load back], for the one file: a plain DataLoader pickles and then fails every
    weights_only load, a lambda does not pickle at all; both are refused by name before anything is written, the
    previous file of that name left as it was; an allow-listed class is saved and loads back."""
    model = torch.nn.Linear(2, 2)
    path = tmp_path / "last.ckpt"
    save_full_checkpoint({"epoch": 1, "state_dict": {}}, path, model, [], None)
    before = path.read_bytes()
    with pytest.raises(CheckpointError, match=re.escape(named) + ".*weights_only=True.*HINT: ") as refused:
        save_full_checkpoint({"epoch": 2, "loader": entry, "state_dict": {}}, path, model, [], None)
    assert "Nothing was written" in str(refused.value)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no staged sibling left
    with torch.serialization.safe_globals([Settings]):
        save_full_checkpoint({"epoch": 2, "loader": Settings(3), "state_dict": {}}, path, model, [], None)
        loaded = torch.load(path, weights_only=True)
    assert (loaded["epoch"], loaded["loader"]) == (2, Settings(3))


class _SavesItsLoader(pl.LightningModule):
    """A LightningModule that puts its DataLoader into its checkpoints (``on_save_checkpoint``)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss: torch.Tensor = self.layer(batch[0]).square().mean()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> torch.utils.data.DataLoader[Any]:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 4)), batch_size=2)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["loader"] = self.trainer.train_dataloader


def _unloadable_full_saves(root: str) -> dict[str, Any]:
    """The Trainer's ``save_checkpoint`` and Fabric's ``save`` of a state holding a DataLoader, one file each."""
    from lightning.fabric import Fabric

    outcome: dict[str, Any] = {}
    trainer = pl.Trainer(
        strategy=ZeroStrategy(stage=3, state_dict_type="full"),
        accelerator="cpu",
        devices=2,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(_SavesItsLoader())
    try:
        trainer.save_checkpoint(f"{root}/trainer.ckpt")
    except CheckpointError as error:
        outcome["trainer"] = str(error)
    fabric = Fabric(strategy=ZeroFabricStrategy(stage=3, state_dict_type="full"), accelerator="cpu", devices=2)
    fabric.launch()  # the Trainer's process group is reused
    model = fabric.setup_module(torch.nn.Linear(4, 4))
    loader = torch.utils.data.DataLoader(torch.arange(4))
    try:
        fabric.save(f"{root}/fabric.ckpt", {"model": model, "loader": loader})
    except CheckpointError as error:
        outcome["fabric"] = str(error)
    fabric.barrier()  # every rank is still in step after the refusal
    outcome["files"] = sorted(p.name for p in Path(root).iterdir())
    return outcome


@pytest.mark.timeout(120)
def test_the_trainer_and_fabric_refuse_a_full_save_that_would_not_load_back_on_every_rank(tmp_path):
    for r in run_distributed(_unloadable_full_saves, 2, str(tmp_path), init_process_group=False):
        for path in ("trainer", "fabric"):
            assert f"{path}.ckpt" in r.get(path, ""), r
            assert "'loader' (a DataLoader)" in r[path], r[path]
        assert r["files"] == [], r["files"]
