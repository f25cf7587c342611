"""The Trainer's two checkpoint options under Fabric: ``state_dict_type="full"`` (``fabric.save`` writes one file as
Fabric's DDP does, which plain ``torch.load`` and a DDP loop's ``fabric.load`` read, and which loads back into ZeRO with
its optimizer state) and ``exclude_frozen_parameters=True`` (a LoRA loop's checkpoints hold the adapters; the frozen
base comes back from what ``fabric.load_raw`` loaded)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from torch import Tensor

from lightning_zero import CheckpointError, ZeroFabricStrategy
from tests.harness import run_distributed
from tests.test_adapter_checkpoint import BASE, lora
from tests.test_checkpoint_trainer import assert_same
from tests.test_fabric_checkpoint import _assert_same_state, _setup, _snapshot, _steps
from tests.test_pretrained_weights import llama_config


def _zero(stage: int, **options: Any) -> Fabric:
    strategy = ZeroFabricStrategy(stage=stage, bucket_numel=3_000, **options)  # parameters straddle ranks
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=2)
    fabric.launch()
    return fabric


def _ddp() -> Fabric:
    fabric = Fabric(strategy="ddp", accelerator="cpu", devices=2)
    fabric.launch()
    return fabric


def _weights(model: Any) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


# -- state_dict_type="full" ------------------------------------------------------------------------------------------
def _state(fabric: Fabric, model: Any, optimizer: Any) -> dict[str, Any]:
    if fabric.strategy._tiers is None:  # type: ignore[attr-defined]
        return _snapshot(fabric, model, optimizer)
    with fabric.strategy.gathered_parameters():  # type: ignore[attr-defined]  # the optimizer state is on disk
        return {"weights": _weights(model)}


def _full_file(root: str, stage: int, options: dict[str, Any]) -> dict[str, Any]:
    fabric = _zero(stage, state_dict_type="full", **options)
    model, optimizer = _setup(fabric)
    _steps(fabric, model, optimizer, 0, 2)
    saved = _state(fabric, model, optimizer)
    fabric.save(f"{root}/full.ckpt", {"model": model, "optimizer": optimizer, "step": 2})
    fabric.save(f"{root}/trainable.ckpt", {"model": model}, filter={"model": lambda k, v: v.requires_grad})
    zero_losses = _steps(fabric, model, optimizer, 2, 4)
    zero_final = _state(fabric, model, optimizer)["weights"]

    fabric = _ddp()  # the oracle resumes from ZeRO's file and goes on as ZeRO does
    model, optimizer = _setup(fabric)
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
    assert fabric.load(f"{root}/full.ckpt", state) == {}
    ddp_loaded = _weights(model)
    ddp_losses = _steps(fabric, model, optimizer, state["step"], 4)
    ddp_final = _weights(model)

    fabric = _zero(3 if stage == 1 else 1)  # back into ZeRO at another stage, optimizer state included
    model, optimizer = _setup(fabric)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    assert fabric.load(f"{root}/full.ckpt", state) == {}
    loaded = _snapshot(fabric, model, optimizer)
    resumed = _steps(fabric, model, optimizer, state["step"], 4)
    return {
        "saved": saved,
        "ddp_loaded": ddp_loaded,
        "loaded": loaded,
        "losses": (zero_losses, ddp_losses, resumed),
        "final": (zero_final, ddp_final, _snapshot(fabric, model, optimizer)["weights"]),
    }


DISK_TIERS = {"offload_optimizer": "disk", "offload_params": "disk"}  # offload_dir: under the test's directory


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("stage", "options"),
    [
        (1, {}),
        (3, {}),
        pytest.param(3, DISK_TIERS, marks=pytest.mark.slow, id="3-disk-tiers"),  # shards and Adam state on disk
    ],
)
def test_full_fabric_checkpoint_is_one_file_that_torch_load_fabric_ddp_and_zero_resume_from(tmp_path, stage, options):
    if options:
        (tmp_path / "tiers").mkdir()
        options = {**options, "offload_dir": str(tmp_path / "tiers")}
    results = run_distributed(_full_file, 2, str(tmp_path), stage, options, init_process_group=False)
    saved = [r["saved"] for r in results]
    if not options:
        _assert_same_state([r["loaded"] for r in results], saved)  # weights, optimizer state and learning rates
    for result in results:
        assert_same(result["ddp_loaded"], saved[0]["weights"])
        zero_losses, ddp_losses, resumed = result["losses"]
        torch.testing.assert_close(ddp_losses, zero_losses, rtol=1e-5, atol=0)
        torch.testing.assert_close(resumed, zero_losses, rtol=1e-5, atol=0)
        zero_final, ddp_final, resumed_final = result["final"]
        assert_same(ddp_final, zero_final, exact=False)
        assert_same(resumed_final, zero_final, exact=False)

    saves = sorted(p.name for p in tmp_path.iterdir() if p.name != "tiers")
    assert saves == ["full.ckpt", "trainable.ckpt"]  # committed, no leftovers
    plain = torch.load(tmp_path / "full.ckpt", weights_only=True)
    assert sorted(plain) == ["model", "optimizer", "step"]  # Fabric's DDP layout, nothing of the sharded format
    assert plain["step"] == 2
    assert_same(plain["model"], saved[0]["weights"])
    assert plain["model"]["model.lm_head.weight"].data_ptr() == plain["model"]["model.wte.weight"].data_ptr()
    assert {n for entry in plain["optimizer"]["state"].values() for n in entry} == {"step", "exp_avg", "exp_avg_sq"}
    trainable = torch.load(tmp_path / "trainable.ckpt", weights_only=True)["model"]
    assert "frozen" not in trainable  # the filter kept what it accepts
    assert "model.wte.weight" in trainable


# -- exclude_frozen_parameters=True ----------------------------------------------------------------------------------
def _lora_batch(rank: int, step: int) -> dict[str, Tensor]:
    tokens = torch.randint(0, BASE["vocab_size"], (4, 16), generator=torch.Generator().manual_seed(100 * rank + step))
    return {"input_ids": tokens, "labels": tokens}


def _lora_setup(fabric: Fabric, hf_dir: str | None) -> tuple[Any, Any]:
    """LoRA on a Llama built on meta at stage 3 (``from_pretrained`` would refuse there), the base from ``hf_dir``."""
    from transformers import LlamaForCausalLM

    with fabric.init_module(empty_init=True):
        raw = lora(LlamaForCausalLM(llama_config(**BASE)))
    model = fabric.setup_module(raw)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW([p for p in raw.parameters() if p.requires_grad], lr=1e-2))
    if hf_dir is not None:
        fabric.load_raw(hf_dir, model)
    return model, optimizer


def _lora_steps(fabric: Fabric, model: Any, optimizer: Any, start: int, stop: int) -> list[float]:
    losses = []
    for step in range(start, stop):
        loss = model(**_lora_batch(fabric.global_rank, step)).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _lora_weights(fabric: Fabric, model: Any) -> dict[str, Tensor]:
    with fabric.strategy.gathered_parameters():  # type: ignore[attr-defined]
        return _weights(model)


def _adapters_only(root: str, hf_dir: str) -> dict[str, Any]:
    fabric = _zero(3, exclude_frozen_parameters=True)
    model, optimizer = _lora_setup(fabric, hf_dir)
    _lora_steps(fabric, model, optimizer, 0, 2)
    fabric.save(f"{root}/adapters.ckpt", {"model": model, "optimizer": optimizer, "step": 2})
    losses = _lora_steps(fabric, model, optimizer, 2, 4)
    final = _lora_weights(fabric, model)

    fabric = _zero(3, exclude_frozen_parameters=True, state_dict_type="full")
    model, optimizer = _lora_setup(fabric, None)  # fresh adapters and a base from nowhere: all from the checkpoint
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(f"{root}/adapters.ckpt", state)
    resumed = _lora_steps(fabric, model, optimizer, state["step"], 4)
    resumed_final = _lora_weights(fabric, model)
    fabric.save(f"{root}/adapters.pt", {"model": model, "optimizer": optimizer})  # one file, the base left out

    fabric = _ddp()  # the base as DDP holds it, the adapters from the file: a full checkpoint to weigh against
    from transformers import LlamaForCausalLM

    model = fabric.setup_module(lora(LlamaForCausalLM.from_pretrained(hf_dir)))
    fabric.load(f"{root}/adapters.pt", {"model": model}, strict=False)
    ddp_loaded = _weights(model)
    fabric.save(f"{root}/ddp.pt", {"model": model})

    refusals = []
    fabric = _zero(3, exclude_frozen_parameters=True)
    model, optimizer = _lora_setup(fabric, None)
    with pytest.raises(ValueError, match=r"exclude_frozen_parameters=True.*no pretrained weights were loaded.*HINT"):
        _lora_steps(fabric, model, optimizer, 0, 1)  # refused at the first backward, before training
    refusals.append("never loaded")
    if fabric.global_rank == 0:
        shutil.move(hf_dir, Path(hf_dir).with_name("moved"))
    fabric.barrier()
    with pytest.raises(CheckpointError, match=r"exclude_frozen_parameters=True.*no longer exists.*HINT"):
        fabric.load(f"{root}/adapters.ckpt", {"model": model, "optimizer": optimizer})
    refusals.append("gone")
    return {
        "losses": (losses, resumed),
        "final": (final, resumed_final),
        "ddp_loaded": ddp_loaded,
        "trainable": sorted(n for n, p in model.module.named_parameters() if p.requires_grad),
        "refusals": refusals,
    }


def _bytes(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@pytest.mark.timeout(120)
def test_lora_fabric_checkpoints_hold_the_adapters_and_resume_exactly_from_load_raws_base(tmp_path):
    from transformers import LlamaForCausalLM

    torch.manual_seed(7)
    LlamaForCausalLM(llama_config(**BASE)).save_pretrained(tmp_path / "hf")
    results = run_distributed(_adapters_only, 2, str(tmp_path), str(tmp_path / "hf"), init_process_group=False)
    for result in results:
        losses, resumed = result["losses"]
        assert resumed == losses  # bit-identical: the base came back from the directory, the rest from the file
        final, resumed_final = result["final"]
        assert_same(resumed_final, final)
        assert_same(result["ddp_loaded"], final)  # DDP's base and the one file's adapters: the run's weights
        assert result["refusals"] == ["never loaded", "gone"]
    trainable = results[0]["trainable"]
    plain = torch.load(tmp_path / "adapters.pt", weights_only=True)
    assert sorted(plain["model"]) == trainable  # the adapters (a Llama has no persistent buffers)
    assert all("lora_" in k for k in trainable)
    assert plain["lightning_zero_frozen"]["source"] == str(tmp_path / "hf")  # where the base comes back from
    full = _bytes(tmp_path / "ddp.pt")
    assert _bytes(tmp_path / "adapters.pt") < 0.1 * full, (_bytes(tmp_path / "adapters.pt"), full)
    assert _bytes(tmp_path / "adapters.ckpt") < 0.3 * full, (_bytes(tmp_path / "adapters.ckpt"), full)
