"""Lightning's own ``EMAWeightAveraging`` under ZeRO (Note [Lightning's WeightAveraging]): at stages 1 and 2 it matches
DDP step for step, its checkpoints (and DDP's) resume exactly and consolidate either set of weights; at stage 3 the
strategy refuses it and names ``ShardedEMA``."""

from __future__ import annotations

import tempfile
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging

from lightning_zero import ShardedEMA, ZeroStrategy
from lightning_zero.cli import consolidate
from lightning_zero.trainer.strategy_checkpoint import refuse_weight_averaging_at_stage_3
from tests.harness import run_distributed
from tests.test_ema import DECAY, SAVE_AT, AtStep, _close, _fit, trainer_weights


def _ema() -> EMAWeightAveraging:
    return EMAWeightAveraging(decay=DECAY, use_buffers=False)


def _zero(stage: int) -> ZeroStrategy:
    return ZeroStrategy(stage=stage, bucket_numel=3_000)


def _run(root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    reference = AtStep(f"{root}/ddp-step{SAVE_AT}.ckpt")  # a single file with the average and the weights
    ddp = _fit("ddp", _ema(), root, reference)
    out["ddp"] = (ddp.train_losses, ddp.val_losses, trainer_weights(ddp), reference.live, reference.average)
    for stage in (1, 2):
        at = AtStep(f"{root}/zero{stage}-step{SAVE_AT}")
        module = _fit(_zero(stage), _ema(), root, at)
        out[f"zero{stage}"] = (module.train_losses, module.val_losses, trainer_weights(module), at.live, at.average)
    resumed = _fit(_zero(2), _ema(), root, AtStep(None), ckpt=f"{root}/zero2-step{SAVE_AT}")
    out["resumed"] = (resumed.train_losses, resumed.val_losses, trainer_weights(resumed))
    from_ddp = _fit(_zero(1), _ema(), root, AtStep(None), ckpt=f"{root}/ddp-step{SAVE_AT}.ckpt")
    out["from_ddp"] = (from_ddp.train_losses, from_ddp.val_losses, trainer_weights(from_ddp))
    return out


@pytest.mark.timeout(240)
def test_lightnings_ema_matches_ddp_at_stages_1_and_2_resumes_exactly_and_consolidates(tmp_path):
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(_run, 2, root, init_process_group=False, timeout=230)
        _, _, _, ddp_live4, ddp_ema4 = results[0]["ddp"]
        # The average is not the live weights: otherwise nothing here could tell them apart.
        assert any(not torch.allclose(ddp_ema4[k], ddp_live4[k], rtol=1e-3) for k in ddp_live4)
        for stage in (1, 2):
            for rank in results:  # each rank against the same rank of the DDP run: its own batches
                ddp_train, ddp_val, ddp_final, ddp_live, ddp_ema = rank["ddp"]
                train, val, final, live4, ema4 = rank[f"zero{stage}"]
                assert val, "validation ran"
                assert train == pytest.approx(ddp_train, rel=1e-5), f"stage {stage} train losses"
                assert val == pytest.approx(ddp_val, rel=1e-5), f"stage {stage} validation losses (the average)"
                _close(live4, ddp_live)
                _close(ema4, ddp_ema)
                _close(final, ddp_final)  # fit ends with the average copied into the model
            for which, expected in (("live", ddp_live4), ("ema", ddp_ema4)):
                out = tmp_path / f"zero{stage}-{which}.ckpt"
                consolidate.consolidate_checkpoint(f"{root}/zero{stage}-step{SAVE_AT}", out, weights=which)
                plain = torch.load(out, weights_only=True)
                assert "current_model_state" not in plain
                _close({k: plain["state_dict"][k] for k in expected}, expected)
        for rank in results:
            train, val, final, _, _ = rank["zero2"]
            resumed_train, resumed_val, resumed_final = rank["resumed"]
            assert resumed_train == train[SAVE_AT:]  # the live weights continue exactly
            assert resumed_val == val[-len(resumed_val) :]  # and so does the average validation sees
            _close(resumed_final, final, exact=True)
            # DDP's checkpoint file, average included, continues under ZeRO as DDP did.
            ddp_train, ddp_val, ddp_final, _, _ = rank["ddp"]
            from_ddp_train, from_ddp_val, from_ddp_final = rank["from_ddp"]
            assert from_ddp_train == pytest.approx(ddp_train[SAVE_AT:], rel=1e-5)
            assert from_ddp_val == pytest.approx(ddp_val[-len(from_ddp_val) :], rel=1e-5)
            _close(from_ddp_final, ddp_final)


def _fit_stage_3_with(callback: str) -> str:
    averaging: pl.Callback = _ema() if callback == "lightning" else ShardedEMA(decay=DECAY)
    try:
        _fit(_zero(3), averaging, tempfile.gettempdir(), AtStep(None))
    except ValueError as error:
        return str(error)
    return "fit ran"


@pytest.mark.timeout(90)
def test_stage_3_refuses_lightnings_ema_and_names_sharded_ema():
    for message in run_distributed(_fit_stage_3_with, 2, "lightning", init_process_group=False):
        assert "EMAWeightAveraging callback cannot run under ZeroStrategy(stage=3)" in message
        assert "HINT: use `lightning_zero.ShardedEMA(decay=..." in message
    assert run_distributed(_fit_stage_3_with, 2, "sharded", init_process_group=False) == ["fit ran"] * 2


@pytest.mark.parametrize("stage", [1, 2])
def test_lightnings_ema_is_accepted_at_stages_1_and_2(stage):
    refuse_weight_averaging_at_stage_3([_ema(), ShardedEMA()], stage)  # raises at stage 3 only
    with pytest.raises(ValueError, match=r"stage=3"):
        refuse_weight_averaging_at_stage_3([_ema()], 3)
