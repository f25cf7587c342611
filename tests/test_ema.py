"""``ShardedEMA`` against Lightning's ``EMAWeightAveraging`` under DDP: the average after K steps, validation with it,
training on with the live weights, exact resume, and consolidation of either set of weights."""

from __future__ import annotations

import tempfile
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ShardedEMA, ZeroStrategy
from lightning_zero.cli import consolidate
from lightning_zero.trainer import ema
from tests.harness import run_distributed
from tests.test_checkpoint_trainer import BATCH, TinyGPT, weights

DECAY = 0.8  # far enough from 1 that the average is clearly not the live weights after a few steps
STEPS, SAVE_AT = 8, 4
TRAINABLE = ("model.",)  # TinyGPT's averaged parameters (its frozen parameter and counting buffer are not)


class ValidatedGPT(TinyGPT):
    """TinyGPT that records its loss at every training step and every validation batch."""

    def __init__(self) -> None:
        super().__init__()
        self.train_losses: list[float] = []
        self.val_losses: list[float] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        self.train_losses.append(float(loss))
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        inputs, targets = batch
        self.val_losses.append(float(nn.functional.cross_entropy(self.model(inputs).flatten(0, 1), targets.flatten())))

    def val_dataloader(self) -> DataLoader:
        tokens = torch.randint(0, 64, (2 * BATCH, 17), generator=torch.Generator().manual_seed(7))
        return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH)


class AtStep(pl.Callback):
    """At optimizer step ``SAVE_AT``: the live weights, the DDP reference's average, and (ZeRO) a checkpoint."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.live: dict[str, Tensor] = {}
        self.average: dict[str, Tensor] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step != SAVE_AT or self.live:
            return
        self.live = trainer_weights(pl_module)
        reference = next((c for c in trainer.callbacks if isinstance(c, EMAWeightAveraging)), None)  # type: ignore[attr-defined]
        if reference is not None and reference._average_model is not None:
            self.average = {k: v.detach().clone() for k, v in reference._average_model.module.state_dict().items()}
        if self.path is not None:
            trainer.save_checkpoint(self.path)


def trainer_weights(module: nn.Module) -> dict[str, Tensor]:
    return {k: v for k, v in weights(module).items() if k.startswith(TRAINABLE)}


def _fit(
    strategy: Any,
    callback: pl.Callback,
    root: str,
    at: AtStep,
    ckpt: str | None = None,
    probe: pl.Callback | None = None,
) -> ValidatedGPT:
    module = ValidatedGPT()
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        val_check_interval=3,  # validation mid-epoch, between updates
        limit_val_batches=2,
        num_sanity_val_steps=0,
        callbacks=[callback, at] if probe is None else [callback, at, probe],
        enable_checkpointing=False,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, ckpt_path=ckpt)
    return module


def _run(root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    reference = AtStep(None)
    ddp = _fit("ddp", EMAWeightAveraging(decay=DECAY, use_buffers=False), root, reference)
    out["ddp"] = (ddp.train_losses, ddp.val_losses, trainer_weights(ddp), reference.live, reference.average)
    for stage in (1, 2, 3):
        at = AtStep(f"{root}/zero{stage}-step{SAVE_AT}")
        module = _fit(ZeroStrategy(stage=stage, bucket_numel=3_000), ShardedEMA(decay=DECAY), root, at)
        out[f"zero{stage}"] = (module.train_losses, module.val_losses, trainer_weights(module), at.live)
    # Resume stage 3 from its step-4 checkpoint; the steps after it must be those of the uninterrupted run.
    resumed = _fit(ZeroStrategy(stage=3, bucket_numel=3_000), ShardedEMA(decay=DECAY), root, AtStep(None),
                   ckpt=f"{root}/zero3-step{SAVE_AT}")  # fmt: skip
    out["resumed"] = (resumed.train_losses, resumed.val_losses, trainer_weights(resumed))
    return out


def _close(actual: dict[str, Tensor], expected: dict[str, Tensor], exact: bool = False) -> None:
    assert actual.keys() == expected.keys()
    tolerance = {"rtol": 0.0, "atol": 0.0} if exact else {"rtol": 1e-6, "atol": 1e-7}
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, **tolerance, msg=name)


@pytest.mark.timeout(240)
def test_sharded_ema_matches_lightnings_ema_under_ddp_resumes_exactly_and_consolidates(tmp_path):
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(_run, 2, root, init_process_group=False, timeout=230)
        _, _, _, ddp_live4, ddp_ema4 = results[0]["ddp"]
        ddp_ema4 = {k: v for k, v in ddp_ema4.items() if k in ddp_live4}
        # The average is not the live weights: otherwise nothing here could tell them apart.
        assert any(not torch.allclose(ddp_ema4[k], ddp_live4[k], rtol=1e-3) for k in ddp_live4)
        for stage in (1, 2, 3):
            for rank in results:  # each rank against the same rank of the DDP run: its own batches
                ddp_train, ddp_val, ddp_final, ddp_live, _ = rank["ddp"]
                assert ddp_val, "the reference validated"
                train, val, final, live4 = rank[f"zero{stage}"]
                # Training sees the live weights, also after every validation; validation sees the average.
                assert train == pytest.approx(ddp_train, rel=1e-5), f"stage {stage} train losses"
                assert val == pytest.approx(ddp_val, rel=1e-5), f"stage {stage} validation losses"
                _close(live4, ddp_live)
                _close(final, ddp_final)  # fit ends with the average copied into the model
            # consolidate exports either set of weights of the step-4 checkpoint.
            for which, expected in (("live", ddp_live4), ("ema", ddp_ema4)):
                out = tmp_path / f"zero{stage}-{which}.ckpt"
                consolidate.consolidate_checkpoint(f"{root}/zero{stage}-step{SAVE_AT}", out, weights=which)
                state = torch.load(out, weights_only=True)["state_dict"]
                _close({k: state[k] for k in expected}, expected)
        for rank in results:
            train, val, final, _ = rank["zero3"]
            resumed_train, resumed_val, resumed_final = rank["resumed"]
            assert resumed_train == train[SAVE_AT:]  # the live weights continue exactly
            assert resumed_val == val[-len(resumed_val) :]
            _close(resumed_final, final, exact=True)  # so does the average


def test_consolidate_without_an_average_says_how_to_get_one(tmp_path):
    toc = {"optimizers": [{"model.w": {"exp_avg": "optim/0/model.w/exp_avg"}}], "state_dict": {}}
    with pytest.raises(consolidate.CheckpointError, match=r"no moving average.*ShardedEMA.*--weights live"):
        consolidate._ema_storage(toc, tmp_path)


def test_the_cli_and_the_callback_name_the_same_state_entry():
    assert consolidate.EMA_STATE == ema.EMA_KEY


@pytest.mark.parametrize(("field", "value"), [("decay", 1.0), ("decay", -0.1), ("update_every_n_steps", -1)])
def test_invalid_arguments_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"ShardedEMA.{field}: {value}"):
        ShardedEMA(**{field: value})


def test_sharded_ema_refuses_other_strategies_with_a_hint(tmp_path):
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False)
    with pytest.raises(TypeError, match=r"HINT: .*EMAWeightAveraging"):
        ShardedEMA().setup(trainer, TinyGPT(), "fit")


def _bf16_with_and_without(root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, callbacks in (("plain", []), ("ema", [ShardedEMA(decay=DECAY)])):
        module = ValidatedGPT()
        trainer = pl.Trainer(
            strategy=ZeroStrategy(stage=2, bucket_numel=3_000),
            accelerator="cpu",
            devices=2,
            precision="bf16-mixed",
            max_steps=6,
            val_check_interval=2,
            limit_val_batches=1,
            callbacks=callbacks,
            enable_checkpointing=False,
            default_root_dir=root,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module)
        zeros = [o for o in trainer.strategy.optimizers if hasattr(o, "masters")]
        out[name] = module.train_losses, module.val_losses
        if name == "ema":
            (zero,) = zeros
            shards = [s.bucket.param_shard[s.start : s.stop] for s in zero.segments]
            out["masters_are_the_average"] = all(torch.equal(m, zero.state[m]["ema"]) for m in zero.masters)
            out["shards_follow"] = all(torch.equal(p, m.to(p.dtype)) for p, m in zip(shards, zero.masters, strict=True))
            out["separate_masters"] = all(p.dtype == torch.bfloat16 for p in shards)
    return out


@pytest.mark.timeout(120)
def test_bf16_swap_restores_the_live_weights_bit_for_bit():
    with tempfile.TemporaryDirectory() as root:
        for rank in run_distributed(_bf16_with_and_without, 2, root, init_process_group=False):
            assert rank["ema"][0] == rank["plain"][0]  # training never sees the average, nor a rounded restore
            assert rank["ema"][1] != rank["plain"][1]  # validation does
            assert rank["separate_masters"]
            assert rank["masters_are_the_average"]  # fit ends with the average in the masters...
            assert rank["shards_follow"]  # ...and in the bf16 parameters


class DiskBytes(pl.Callback):
    """The model-state bytes in the disk tier during training: proof that the tiers were in use."""

    def __init__(self) -> None:
        self.disk = 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.disk = max(self.disk, trainer.strategy.tier_bytes().disk)  # type: ignore[attr-defined]


def _run_tiered(root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ddp = _fit("ddp", EMAWeightAveraging(decay=DECAY, use_buffers=False), root, AtStep(None))
    out["ddp"] = (ddp.train_losses, ddp.val_losses, trainer_weights(ddp))
    for stage, tiers in (
        (2, {"offload_optimizer": "disk"}),
        (3, {"offload_optimizer": "disk", "offload_params": "disk"}),
    ):
        strategy = ZeroStrategy(stage=stage, bucket_numel=3_000, offload_dir="offload", **tiers)
        probe = DiskBytes()
        module = _fit(strategy, ShardedEMA(decay=DECAY), root, AtStep(None), probe=probe)
        out[f"zero{stage}"] = (module.train_losses, module.val_losses, trainer_weights(module), probe.disk)
    return out


@pytest.mark.timeout(240)
def test_sharded_ema_with_the_state_on_disk_matches_lightnings_ema_under_ddp():
    # Note [averages in the tiers]: the average lives in the tier file with the optimizer state it belongs to.
    with tempfile.TemporaryDirectory() as root:
        for rank in run_distributed(_run_tiered, 2, root, init_process_group=False, timeout=230):
            ddp_train, ddp_val, ddp_final = rank["ddp"]
            assert ddp_val, "the reference validated"
            for stage in (2, 3):
                train, val, final, disk = rank[f"zero{stage}"]
                assert disk > 0, "the optimizer state (and the average) lived in the disk tier"
                assert train == pytest.approx(ddp_train, rel=1e-5), f"stage {stage} train losses"
                assert val == pytest.approx(ddp_val, rel=1e-5), f"stage {stage} validation losses (the average)"
                _close(final, ddp_final)  # fit ends with the average copied into the model


class TierReadsPerUpdate(pl.Callback):
    """Around ``ShardedEMA``'s update (one instance before it, ``after`` after it in the callbacks): the tier entries
    each update acquires, their sizes, and the bytes read from the tier file meanwhile."""

    def __init__(self, after: TierReadsPerUpdate | None = None) -> None:
        self.after = after
        self.updates: list[dict[str, Any]] = []
        self._start: tuple[int, list[tuple[Any, int]]] | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        tiers = trainer.strategy.memory_tiers  # type: ignore[attr-defined]
        swapper = tiers.swapper
        if self.after is not None:  # before the update: start recording
            acquired: list[tuple[Any, int]] = []
            original = swapper.acquire

            def recording(key: Any, read: bool = True, **kwargs: Any) -> Any:
                if read:  # not a new entry about to be written (the first average)
                    acquired.append((key, swapper._entries[key].nbytes))
                return original(key, read, **kwargs)

            swapper.acquire = recording
            self.after._start = (tiers.io_bytes()[0], acquired)
            return
        assert self._start is not None
        read_before, acquired = self._start
        del swapper.acquire  # the method again
        kinds: dict[tuple[str, ...], int] = {}
        for key, nbytes in acquired:
            kind = (key[0], key[3]) if key[0] == "state" else (key[0],)
            kinds[kind] = kinds.get(kind, 0) + nbytes
        self.updates.append({"kinds": kinds, "read": tiers.io_bytes()[0] - read_before})


def _ema_tier_reads(root: str) -> dict[str, Any]:
    """Per precision: the tier reads of each update, and the final (averaged) weights with and without tiers."""
    out: dict[str, Any] = {}
    for precision in ("32-true", "bf16-mixed"):
        for tiers in ({"offload_optimizer": "disk", "offload_params": "disk", "offload_dir": "offload"}, {}):
            after = TierReadsPerUpdate()
            module = ValidatedGPT()
            trainer = pl.Trainer(
                strategy=ZeroStrategy(stage=3, bucket_numel=3_000, **tiers),
                accelerator="cpu",
                devices=2,
                precision=precision,  # type: ignore[arg-type]
                max_steps=4,
                limit_val_batches=0,
                callbacks=[TierReadsPerUpdate(after), ShardedEMA(decay=DECAY), after] if tiers else [ShardedEMA(DECAY)],
                enable_checkpointing=False,
                default_root_dir=root,
                logger=False,
                enable_progress_bar=False,
                enable_model_summary=False,
            )
            trainer.fit(module)
            out[f"{precision}/{'disk' if tiers else 'memory'}"] = (after.updates, trainer_weights(module))
    return out


@pytest.mark.timeout(120)
def test_an_ema_update_in_the_disk_tier_reads_only_the_masters_and_their_averages():
    """Note [averages in the tiers]: an update needs each bucket's masters (the fp32 parameter shards, or the
    separate fp32 masters under mixed precision) and their averages; not the gradients, Adam's moments, the bf16
    parameter shards, nor what the step would read next."""
    with tempfile.TemporaryDirectory() as root:
        for rank in run_distributed(_ema_tier_reads, 2, root, init_process_group=False, timeout=110):
            for precision, masters in (("32-true", "param"), ("bf16-mixed", "master")):
                (first, *later), averaged = rank[f"{precision}/disk"]
                _close(averaged, rank[f"{precision}/memory"][1])  # the same average as without tiers
                assert len(later) == 3, precision
                assert list(first["kinds"]) == [(masters,)], precision  # the first update copies the masters
                assert first["read"] == first["kinds"][(masters,)] > 0, precision
                for update in later:  # nothing read ahead either: the bytes read are those of the entries used
                    assert sorted(update["kinds"]) == [(masters,), ("state", ema.EMA_KEY)], precision
                    assert update["read"] == sum(update["kinds"].values()), precision
                    assert update["kinds"][(masters,)] == first["kinds"][(masters,)], precision
