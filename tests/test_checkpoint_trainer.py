"""Sharded checkpoints through Lightning's Trainer, on gloo ranks: exact resume, resharding across world sizes and
stages, DDP checkpoints and pretrained weights into ZeRO, consolidation, ModelCheckpoint's top-k / last, and a crash
in the middle of a save.
"""

from __future__ import annotations

import os
import signal
import tempfile
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import lightning
import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from packaging.version import Version
from torch import Tensor, nn
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero  # noqa: F401  (registers the presets)
from lightning_zero import ZeroConfig, ZeroOptimizer, ZeroStrategy
from lightning_zero.__main__ import main as cli
from lightning_zero.checkpoint.full_weights import load_full_state_dict
from lightning_zero.checkpoint.sharded_checkpoint import owned_parameter_slices
from lightning_zero.models.gpt import GPT, GPTConfig
from lightning_zero.models.param_groups import param_groups_with_weight_decay
from tests.harness import DistributedTestError, run_distributed

SAMPLES, BATCH = 64, 4


class ResumableLoader(DataLoader):
    """Skips the batches of the current epoch that were consumed before the checkpoint (a minimal stateful loader:
    without one, Lightning restarts a resumed epoch from its first batch)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.yielded = 0
        self.skip = 0

    def __iter__(self) -> Iterator[Any]:
        skip, self.skip = self.skip, 0
        self.yielded = skip
        for i, batch in enumerate(super().__iter__()):
            if i >= skip:
                self.yielded += 1
                yield batch

    def state_dict(self) -> dict[str, int]:
        return {"yielded": self.yielded % len(self)}  # a finished epoch resumes at the next one's start

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skip = state["yielded"]


class TinyGPT(pl.LightningModule):
    """Tied embeddings, two param groups, a per-step LR schedule, a frozen parameter and a counting buffer."""

    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(1234)
        self.model = GPT(GPTConfig.tiny(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16, bias=False))
        self.frozen = nn.Parameter(torch.randn(5), requires_grad=False)  # in no bucket: replicated on every rank
        self.register_buffer("batches_seen", torch.zeros((), dtype=torch.long))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        self.batches_seen += 1
        inputs, targets = batch
        return nn.functional.cross_entropy(self.model(inputs).flatten(0, 1), targets.flatten())

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.validated = weights(self)  # what a checkpoint loaded without optimizers put in place

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(param_groups_with_weight_decay(self.model, 0.1), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        tokens = torch.randint(0, 64, (SAMPLES, 17), generator=torch.Generator().manual_seed(99))
        return ResumableLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH, shuffle=True)


def fit(
    strategy: Any,
    devices: int,
    steps: int,
    root: str,
    ckpt: str | None = None,
    callbacks: Any = (),
    precision: str = "32-true",
) -> TinyGPT:
    module = TinyGPT()
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        precision=precision,
        max_steps=steps,
        callbacks=list(callbacks),
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, ckpt_path=ckpt)
    return module


def zero(stage: int) -> ZeroStrategy:
    return ZeroStrategy(stage=stage, bucket_numel=3_000)  # several buckets; parameters straddle ranks


def weights(module: nn.Module) -> dict[str, Tensor]:
    """The full state dict on every rank (stage 3 gathers its sharded parameters for the copy)."""
    trainer = getattr(module, "_trainer", None)
    strategy = trainer.strategy if trainer is not None else None
    context = strategy.gathered_parameters() if isinstance(strategy, ZeroStrategy) else nullcontext()
    with context:
        return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_same(actual: dict[str, Tensor], expected: dict[str, Tensor], exact: bool = True) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        tolerance = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-6}
        torch.testing.assert_close(actual[name], value, **tolerance, msg=name)


class Snapshot(pl.Callback):
    """Records the full model and this rank's slices of optimizer state when a save starts or training starts."""

    def __init__(self, at: str) -> None:
        self.at = at
        self.taken: dict[str, Any] | None = None

    def on_save_checkpoint(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.at == "save" and self.taken is None:
            self.taken = _snapshot(trainer)

    def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.at == "start":
            self.taken = _snapshot(trainer)


def _snapshot(trainer: pl.Trainer) -> dict[str, Any]:
    state: list[tuple[str, str, int | None, Tensor]] = []  # (fqn, state name, start or None for 0-d, values)
    optimizers = list(trainer.strategy.optimizers)
    if all(isinstance(o, ZeroOptimizer) for o in optimizers):
        for s in owned_parameter_slices(optimizers, getattr(trainer.strategy, "_gatherer", None)):
            if s.state_key is not None:
                for name, value in optimizers[s.optimizer].state.get(s.state_key, {}).items():
                    piece = value if value.dim() == 0 else value[s.state_offset : s.state_offset + s.stop - s.start]
                    state.append((s.fqn, name, None if value.dim() == 0 else s.start, piece.clone()))
    else:  # DDP: full state per parameter
        names = {id(p): n for n, p in trainer.lightning_module.named_parameters()}
        for p, entry in optimizers[0].state.items():
            for k, v in entry.items():
                start = None if v.dim() == 0 else 0
                state.append((names[id(p)], k, start, v.flatten().clone() if start == 0 else v.clone()))
    return {
        "weights": weights(trainer.lightning_module),
        "state": state,
        "lrs": [g["lr"] for g in optimizers[0].param_groups],
        "step": trainer.global_step,
    }


def full_state(snapshots: list[dict[str, Any]]) -> dict[tuple[str, str], Tensor]:
    """Every rank's optimizer-state slices put back together, per (parameter, state name)."""
    full: dict[tuple[str, str], Tensor] = {}
    for snapshot in snapshots:
        for fqn, name, start, piece in snapshot["state"]:
            if start is None:
                full[(fqn, name)] = piece
                continue
            numel = snapshots[0]["weights"][fqn].numel()
            target = full.setdefault((fqn, name), torch.full((numel,), float("nan")))
            target[start : start + piece.numel()] = piece
    return full


def assert_same_training_state(loaded: list[dict[str, Any]], saved: list[dict[str, Any]]) -> None:
    assert [s["step"] for s in loaded] == [saved[0]["step"]] * len(loaded)
    assert all(s["lrs"] == saved[0]["lrs"] for s in loaded)
    for snapshot in loaded:
        assert_same(snapshot["weights"], saved[0]["weights"])
    expected, actual = full_state(saved), full_state(loaded)
    assert actual.keys() == expected.keys()
    assert len(actual) > 0
    for key, value in expected.items():
        assert torch.equal(actual[key], value), key


# -- exact resume ----------------------------------------------------------------------------------------------------
def _resume_exactly(root: str, stage: int, devices: int, boundary_too: bool, precision: str) -> list[dict]:
    per_epoch = SAMPLES // (BATCH * devices)
    saves = ModelCheckpoint(dirpath=f"{root}/ck", every_n_train_steps=per_epoch // 2, save_top_k=-1)
    uninterrupted = weights(fit(zero(stage), devices, per_epoch + 2, root, callbacks=[saves], precision=precision))
    results = [uninterrupted]
    starts = [per_epoch // 2, per_epoch] if boundary_too else [per_epoch // 2]  # mid-epoch, end of the epoch
    for start in starts:
        ckpt = f"{root}/ck/epoch=0-step={start}.ckpt"
        results.append(weights(fit(zero(stage), devices, per_epoch + 2, root, ckpt=ckpt, precision=precision)))
    return results


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("stage", "devices", "boundary_too", "precision"),
    [
        (1, 2, True, "32-true"),
        (2, 2, True, "32-true"),
        (2, 1, False, "32-true"),
        (1, 4, False, "32-true"),
        (1, 1, False, "32-true"),
        (2, 4, False, "32-true"),
        (2, 2, False, "bf16-mixed"),  # bf16 parameters, separate fp32 masters
        (1, 2, False, "16-mixed"),  # fp16 parameters and the dynamic loss scaler's state
    ],
)
def test_resumed_training_is_bit_identical_to_uninterrupted(stage, devices, boundary_too, precision):
    if boundary_too and Version(lightning.__version__) < Version("2.5"):
        pytest.skip("Lightning 2.4 resumes a checkpoint saved at the end of an epoch inexactly, under DDP too")
    with tempfile.TemporaryDirectory() as root:
        for uninterrupted, *resumed in run_distributed(
            _resume_exactly, devices, root, stage, devices, boundary_too, precision, init_process_group=False
        ):
            assert len(resumed) == (2 if boundary_too else 1)
            for weights_after_resume in resumed:
                assert_same(weights_after_resume, uninterrupted)


# -- resharding ------------------------------------------------------------------------------------------------------
def _save_at_step_4(root: str, stage: int) -> dict[str, Any]:
    snapshot = Snapshot(at="save")
    fit(zero(stage), 2, 4, root, callbacks=[snapshot, ModelCheckpoint(dirpath=f"{root}/w2", every_n_train_steps=4)])
    assert snapshot.taken is not None
    return snapshot.taken


def _load(root: str, ckpt: str, stage: int, devices: int, save_to: str | None) -> dict[str, Any]:
    snapshot = Snapshot(at="start")

    class SaveAtStart(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
            if save_to is not None:
                trainer.save_checkpoint(save_to)

    module = fit(zero(stage), devices, 6, root, ckpt=ckpt, callbacks=[snapshot, SaveAtStart()])
    assert int(module.batches_seen) == 6 * 1  # buffer restored (4) + 2 more steps on this rank
    assert snapshot.taken is not None
    return snapshot.taken


@pytest.mark.timeout(150)
def test_checkpoints_reshard_across_world_sizes_and_stages():
    with tempfile.TemporaryDirectory() as root:
        saved = run_distributed(_save_at_step_4, 2, root, 2, init_process_group=False)
        source = f"{root}/w2/epoch=0-step=4.ckpt"
        # 2 -> 4 ranks and stage 2 -> 1, saved again at 4 ranks; then 4 -> 2 ranks and stage 1 -> 2; 2 -> 1 rank.
        at4 = run_distributed(_load, 4, root, source, 1, 4, f"{root}/w4.ckpt", init_process_group=False)
        at2 = run_distributed(_load, 2, root, f"{root}/w4.ckpt", 2, 2, None, init_process_group=False)
        at1 = run_distributed(_load, 1, root, source, 1, 1, None, init_process_group=False)
    for loaded in (at4, at2, at1):
        assert_same_training_state(loaded, saved)


# -- full checkpoints and weights into ZeRO; consolidation back to one file -----------------------------------------
def _ddp_then_zero(root: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Tensor], dict[str, Tensor]]:
    at_save = Snapshot(at="save")
    saves = ModelCheckpoint(dirpath=f"{root}/ddp", every_n_train_steps=4, save_top_k=-1)
    ddp = weights(fit("ddp", 2, 8, root, callbacks=[at_save, saves]))
    at_load = Snapshot(at="start")
    final = ModelCheckpoint(dirpath=f"{root}/zero", every_n_train_steps=4, save_top_k=-1)
    zero_run = fit(zero(2), 2, 8, root, ckpt=f"{root}/ddp/epoch=0-step=4.ckpt", callbacks=[at_load, final])
    assert at_save.taken is not None
    assert at_load.taken is not None
    return at_save.taken, at_load.taken, ddp, weights(zero_run)


@pytest.mark.timeout(120)
def test_ddp_checkpoint_seeds_zero_and_consolidates_to_the_weights_ddp_reaches():
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(_ddp_then_zero, 2, root, init_process_group=False)
        ddp_saved, _, ddp_final, zero_final = results[0]
        # The DDP state went into the shards exactly, optimizer state included; training then matches DDP.
        assert_same_training_state([r[1] for r in results], [ddp_saved])
        assert_same(zero_final, ddp_final, exact=False)

        out = Path(root, "plain.ckpt")
        assert cli(["consolidate", f"{root}/zero/epoch=0-step=8.ckpt", str(out)]) == 0
        plain = torch.load(out, weights_only=True)
        assert plain["global_step"] == 8
        assert "optimizer_states" not in plain
        module = TinyGPT()
        module.load_state_dict(plain["state_dict"])  # strict: every key, tied names included
        assert_same(weights(module), ddp_final, exact=False)
        restored = TinyGPT.load_from_checkpoint(out)
        assert_same(weights(restored), weights(module))


def _pretrained(path: str, dtype: torch.dtype) -> list[bool]:
    torch.manual_seed(dist.get_rank())  # every rank starts elsewhere; the load must overwrite all of it
    model = GPT(GPTConfig.tiny(n_layer=1, n_embd=32, n_head=2, vocab_size=64, block_size=16, bias=False)).to(dtype)
    optimizer = ZeroOptimizer(model, torch.optim.AdamW(model.parameters()), dist.group.WORLD, ZeroConfig(stage=2))
    load_full_state_dict(model, path, optimizers=[optimizer])
    expected = torch.load(path, weights_only=True)
    same = [torch.equal(v, expected[k].to(dtype)) for k, v in model.state_dict().items()]
    for s in owned_parameter_slices([optimizer]):  # the fp32 masters hold the exact pretrained values
        if s.master is not None:
            same.append(torch.equal(s.master, expected[s.fqn].reshape(-1)[s.start : s.stop]))
    model(torch.zeros(2, 8, dtype=torch.long)).float().sum().backward()
    optimizer.step()
    return same


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pretrained_state_dict_loads_into_a_sharded_model(tmp_path, dtype):
    torch.manual_seed(0)
    source = GPT(GPTConfig.tiny(n_layer=1, n_embd=32, n_head=2, vocab_size=64, block_size=16, bias=False))
    torch.save(source.state_dict(), tmp_path / "pretrained.pt")
    for same in run_distributed(_pretrained, 2, str(tmp_path / "pretrained.pt"), dtype):
        assert same
        assert all(same)


# -- ModelCheckpoint with directories; a crash in the middle of a save --------------------------------------------
def _top_k_and_last_link(root: str) -> tuple[list[str], str, int, dict[str, Tensor], dict[str, Tensor]]:
    ck = f"{root}/ck"
    keep = ModelCheckpoint(
        dirpath=ck, monitor="step", mode="max", save_top_k=2, every_n_train_steps=1, save_last="link"
    )
    trained = weights(fit(zero(1), 2, 5, root, callbacks=[keep]))
    listing, link = sorted(os.listdir(ck)), os.readlink(f"{ck}/last.ckpt")
    dist.barrier()
    start = Snapshot(at="start")
    fit(zero(1), 2, 6, root, ckpt="last", callbacks=[start, ModelCheckpoint(dirpath=ck, save_last="link")])
    assert start.taken is not None
    # Outside fit there are no optimizers, so nothing is sharded: every rank reads whole tensors.
    module = TinyGPT()
    quiet = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}
    validator = pl.Trainer(strategy=zero(1), accelerator="cpu", devices=2, limit_val_batches=1, **quiet)
    validator.validate(module, module.train_dataloader(), ckpt_path=f"{ck}/epoch=0-step=5.ckpt", verbose=False)
    return listing, link, start.taken["step"], trained, module.validated


@pytest.mark.timeout(90)
def test_top_k_removal_last_link_and_validate_work_with_checkpoint_directories():
    with tempfile.TemporaryDirectory() as root:
        for listing, link, resumed_at, trained, validated in run_distributed(
            _top_k_and_last_link, 2, root, init_process_group=False
        ):
            assert listing == ["epoch=0-step=4.ckpt", "epoch=0-step=5.ckpt", "last.ckpt"]
            assert link == "epoch=0-step=5.ckpt"
            assert resumed_at == 5
            assert_same(validated, trained)


def _die_in_second_save(root: str) -> None:
    write_data = FileSystemWriter.write_data
    calls = []

    def write_then_die(self: FileSystemWriter, *args: Any, **kwargs: Any) -> Any:
        future = write_data(self, *args, **kwargs)  # this rank's shard file is on disk, nothing is committed
        calls.append(1)
        if len(calls) == 2 and dist.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        return future

    FileSystemWriter.write_data = write_then_die  # type: ignore[method-assign]
    fit(
        zero(2),
        2,
        4,
        root,
        callbacks=[ModelCheckpoint(dirpath=f"{root}/ck", every_n_train_steps=2, save_top_k=0, save_last=True)],
    )


def _resume_from_last(root: str) -> int:
    start = Snapshot(at="start")
    last = ModelCheckpoint(dirpath=f"{root}/ck", every_n_train_steps=2, save_top_k=0, save_last=True)
    fit(zero(2), 2, 4, root, ckpt="last", callbacks=[start, last])
    assert start.taken is not None
    return start.taken["step"]


@pytest.mark.timeout(120)
def test_crash_mid_save_keeps_the_previous_checkpoint_and_never_offers_the_partial_one():
    with tempfile.TemporaryDirectory() as root:
        with pytest.raises(DistributedTestError, match="rank 0") as crash:
            run_distributed(_die_in_second_save, 2, root, init_process_group=False, timeout=60)
        assert "SIGKILL" in crash.value.failures[0]
        listing = sorted(os.listdir(f"{root}/ck"))
        assert listing[0].startswith(".last.ckpt.partial-")
        assert listing[1:] == ["last.ckpt"]
        # ckpt_path="last" resolves to the complete checkpoint of step 2; the next save clears the partial one.
        assert run_distributed(_resume_from_last, 2, root, init_process_group=False) == [2, 2]
        assert sorted(os.listdir(f"{root}/ck")) == ["last.ckpt"]


def _die_in_the_second_commit_without_exchange(root: str) -> None:
    from lightning_zero.checkpoint import local_commit

    local_commit._exchange = lambda a, b: False  # type: ignore[assignment]  # as on NFS, Lustre, FUSE
    rename, into_last = os.rename, []

    def rename_or_die(src: Any, dst: Any) -> None:
        if os.fspath(dst) == f"{root}/ck/last.ckpt":
            into_last.append(src)
            if len(into_last) == 2 and dist.get_rank() == 0:  # the new save is complete, its commit not done
                os.kill(os.getpid(), signal.SIGKILL)
        rename(src, dst)

    os.rename = rename_or_die  # type: ignore[assignment]
    fit(
        zero(2),
        2,
        4,
        root,
        callbacks=[ModelCheckpoint(dirpath=f"{root}/ck", every_n_train_steps=2, save_top_k=0, save_last=True)],
    )


@pytest.mark.timeout(120)
def test_crash_in_a_commit_without_exchange_resumes_from_the_previous_checkpoint():
    """On a filesystem without RENAME_EXCHANGE (NFS, Lustre, FUSE) last.ckpt is a link renamed over the old one."""
    with tempfile.TemporaryDirectory() as root:
        with pytest.raises(DistributedTestError, match="rank 0") as crash:
            run_distributed(_die_in_the_second_commit_without_exchange, 2, root, init_process_group=False, timeout=60)
        assert "SIGKILL" in crash.value.failures[0]
        assert os.path.islink(f"{root}/ck/last.ckpt")  # still the first save's
        # ckpt_path="last" resolves to the complete checkpoint of step 2; its next save clears what is left.
        assert run_distributed(_resume_from_last, 2, root, init_process_group=False) == [2, 2]
        assert sorted(os.listdir(f"{root}/ck")) == ["last.ckpt"]
