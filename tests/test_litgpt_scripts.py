"""LitGPT's LoRA and full fine-tuning scripts, unchanged, under ``Fabric(strategy="zero3")`` against Fabric's DDP on
2 gloo ranks (``tests/litgpt_runs.py``): the losses they log, the adapters they save at every save interval and at
the end (from ``model.state_dict()`` on every rank, saved by rank 0), the weights ``merge_lora`` merges from those
files, and the full checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests import litgpt_runs
from tests.harness import run_distributed

pytest.importorskip("litgpt")


def _finetune(script, strategy, checkpoint, data, out, precision="32-true"):
    return run_distributed(
        litgpt_runs.run_script, 2, script, strategy, str(checkpoint), str(data), str(out), precision,
        init_process_group=False, timeout=400.0,
    )  # fmt: skip


def _files(out: Path, pattern: str) -> dict[str, dict[str, torch.Tensor]]:
    found = {}
    for path in sorted(out.glob(pattern)):
        state = torch.load(path, weights_only=True)
        found[str(path.relative_to(out))] = state.get("model", state)
    return found


def _assert_same(ddp, zero, tolerance):
    assert ddp.keys() == zero.keys()
    for name in ddp:
        assert ddp[name].keys() == zero[name].keys(), name
        for key, value in ddp[name].items():
            assert torch.isfinite(zero[name][key].float()).all(), (name, key)
            torch.testing.assert_close(zero[name][key], value, rtol=tolerance, atol=tolerance, msg=f"{name}: {key}")


def test_litgpt_lora_script_matches_ddp(tmp_path):
    checkpoint = litgpt_runs.make_checkpoint(tmp_path)
    data = litgpt_runs.make_data(tmp_path)
    ddp = _finetune("lora", "ddp", checkpoint, data, tmp_path / "ddp")
    zero = _finetune("lora", "zero3", checkpoint, data, tmp_path / "zero3")
    # generate_example samples on rank 0 alone while rank 1 waits in fabric.barrier(), at both evaluations
    assert len(ddp[0]["samples"]) == 2, ddp
    assert not ddp[1]["samples"]
    assert zero[0]["samples"] == ddp[0]["samples"]
    assert not zero[1]["samples"]
    for d, z in zip(ddp, zero, strict=True):
        losses = [m for m in d["metrics"] if "loss" in m]
        assert len(losses) == 4, d["metrics"]
        assert sum("val_loss" in m for m in d["metrics"]) >= 2, d["metrics"]
        assert [m.keys() for m in z["metrics"]] == [m.keys() for m in d["metrics"]]
        for dm, zm in zip(d["metrics"], z["metrics"], strict=True):
            for key, value in dm.items():
                assert zm[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (key, dm, zm)
    adapters = _files(tmp_path / "ddp", "*/lit_model.pth.lora")
    assert sorted(adapters) == [
        "final/lit_model.pth.lora",
        "step-000002/lit_model.pth.lora",
        "step-000004/lit_model.pth.lora",
    ]
    _assert_same(adapters, _files(tmp_path / "zero3", "*/lit_model.pth.lora"), 1e-5)
    merged = _files(tmp_path / "ddp", "final/lit_model.pth")
    _assert_same(merged, _files(tmp_path / "zero3", "final/lit_model.pth"), 1e-5)


@pytest.mark.slow
def test_litgpt_full_finetuning_script_matches_ddp(tmp_path):
    """``finetune/full.py``: ``load_checkpoint`` with ``strict=True`` (the lazily loaded file through
    ``model.load_state_dict``), sampling on every rank, ``fabric.save`` of the whole state at each save interval and of
    the model at the end; zero3 writes sharded directories, consolidated here into DDP's layout."""
    from lightning_zero.cli.consolidate import consolidate_checkpoint

    checkpoint = litgpt_runs.make_checkpoint(tmp_path)
    torch.save(litgpt_runs.base_weights(), checkpoint / "lit_model.pth")
    data = litgpt_runs.make_data(tmp_path)
    ddp = _finetune("full", "ddp", checkpoint, data, tmp_path / "ddp")
    zero = _finetune("full", "zero3", checkpoint, data, tmp_path / "zero3")
    for d, z in zip(ddp, zero, strict=True):
        assert len([m for m in d["metrics"] if "loss" in m]) == 4
        for dm, zm in zip(d["metrics"], z["metrics"], strict=True):
            for key, value in dm.items():
                assert zm[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (key, dm, zm)
    for name in ("step-000002", "step-000004", "final"):
        full = consolidate_checkpoint(tmp_path / "zero3" / name / "lit_model.pth", tmp_path / f"{name}.ckpt")
        zero_weights = torch.load(full, weights_only=True)["state_dict"]
        ddp_weights = torch.load(tmp_path / "ddp" / name / "lit_model.pth", weights_only=True)["model"]
        _assert_same({name: ddp_weights}, {name: zero_weights}, 1e-5)


def _pretrain(strategy, out, iterations, resume):
    return run_distributed(
        litgpt_runs.run_pretrain, 2, strategy, str(out), iterations, resume, init_process_group=False, timeout=400.0
    )


@pytest.mark.slow
def test_litgpt_pretrain_script_matches_ddp_and_resumes(tmp_path):
    """``pretrain.py``: the model built under ``init_module(empty_init=True)`` and initialized by the script's own
    ``reset_parameters`` overrides, tied embeddings, ``torch.compile``, ``fabric.save`` of the whole state (its
    loader included) every 2 steps, then ``resume="auto"`` from the last of them; the losses, and the final weights
    consolidated into DDP's layout, are DDP's."""
    from lightning_zero.cli.consolidate import consolidate_checkpoint

    runs = {}
    for strategy in ("ddp", "zero3"):
        first = _pretrain(strategy, tmp_path / strategy, 12, resume=False)
        resumed = _pretrain(strategy, tmp_path / strategy, 16, resume=True)
        for result in resumed:  # from the save at iteration 12: its iterations 14 and 16 are logged
            assert [m["iter"] for m in result["metrics"] if "iter" in m] == [14.0, 16.0], result
        runs[strategy] = [a["metrics"] + b["metrics"] for a, b in zip(first, resumed, strict=True)]
    for d, z in zip(runs["ddp"], runs["zero3"], strict=True):
        assert [m.keys() for m in z] == [m.keys() for m in d]
        for dm, zm in zip(d, z, strict=True):
            for key, value in dm.items():
                assert zm[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (key, dm, zm)
    full = consolidate_checkpoint(tmp_path / "zero3" / "final" / "lit_model.pth", tmp_path / "final.ckpt")
    zero_weights = torch.load(full, weights_only=True)["state_dict"]
    ddp_weights = torch.load(tmp_path / "ddp" / "final" / "lit_model.pth", weights_only=True)["model"]
    _assert_same({"final": ddp_weights}, {"final": zero_weights}, 1e-5)
