"""Lightning's checkpoint hooks read and edit ``checkpoint["state_dict"]`` under ZeRO as under DDP, at every stage:
``on_save_checkpoint`` reading every entry (a norm), putting an EMA's weights in, renaming an entry, dropping the
frozen base, adding and casting entries, and the file holds what they left; a write into an entry in place is refused
before anything is written; ``on_load_checkpoint`` mapping the keys of a model whose child was renamed resumes as
DDP's and as the uninterrupted run, a tensor it puts in (or computes from an entry it reads, under ``validate``'s
inference mode) loads as under DDP, without the mapping strict loading refuses, and an edit under ``rank_zero_only``
(which DDP would load as different weights on each rank) is refused on every rank; a Fabric loop's stateful object
holding DTensors is saved and loaded whole (Note [checkpoint hooks see the model's values], Note [on_load_checkpoint
edits what loads])."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_zero.checkpoint.format import open_committed
from lightning_zero.checkpoint.frozen import FROZEN_KEY
from lightning_zero.checkpoint.storage import locate
from tests import checkpoint_hook_runs as runs
from tests.harness import run_distributed

TOLERANCE = {"32-true": (1e-5, 1e-6), "bf16-mixed": (2e-2, 1e-2), "bf16-true": (5e-2, 2e-2)}


def _save_both(root: str, options: dict[str, Any], precision: str, model: Any) -> dict[str, Any]:
    return {name: runs.save_with_hooks(name, options, precision, model, root) for name in ("ddp", "zero")}


def _lora(hf_dir: str) -> Any:
    from tests.test_adapter_checkpoint import LoraFineTune

    return LoraFineTune(hf_dir)


def _gpt_cases() -> list[Any]:
    slow = pytest.mark.slow
    return [
        pytest.param({"stage": 3}, "32-true", id="stage3"),
        pytest.param({"stage": 1}, "32-true", id="stage1", marks=slow),
        pytest.param({"stage": 2}, "bf16-mixed", id="stage2-bf16", marks=slow),
        pytest.param({"stage": 3}, "bf16-mixed", id="stage3-bf16", marks=slow),
        pytest.param({"stage": 3}, "bf16-true", id="stage3-bf16-masters", marks=slow),
        pytest.param({"stage": 1}, "bf16-true", id="stage1-bf16-masters", marks=slow),
        pytest.param({"stage": 3, "state_dict_type": "full"}, "32-true", id="stage3-full", marks=slow),
        pytest.param({"stage": 3, "async_save": True}, "bf16-mixed", id="stage3-async-bf16", marks=slow),
        pytest.param({"stage": 2, "state_dict_type": "full"}, "bf16-mixed", id="stage2-full-bf16", marks=slow),
        pytest.param(
            {"stage": 3, "offload_params": "disk", "offload_optimizer": "disk"},
            "bf16-mixed",
            id="stage3-disk-bf16",
            marks=slow,
        ),
    ]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("options", "precision"), _gpt_cases())
def test_save_hooks_see_the_models_values_and_the_file_holds_what_they_left_as_under_ddp(tmp_path, options, precision):
    options = dict(options)
    if "offload_dir" not in options and "disk" in options.values():
        options["offload_dir"] = str(tmp_path / "offload")
        os.makedirs(options["offload_dir"])
    results = run_distributed(
        _save_both, 2, str(tmp_path), options, precision, runs.LoggedGPT, init_process_group=False, timeout=220
    )[0]
    _assert_saved_like_ddp(results, options, precision, tmp_path)


def _assert_saved_like_ddp(results: dict[str, Any], options: dict[str, Any], precision: str, root: Path) -> None:
    ddp, zero = results["ddp"], results["zero"]
    full = options.get("state_dict_type") == "full"
    expected_types = ["Tensor"] if options["stage"] < 3 else ["LazyEntry" if full else "DTensor", "Tensor"]
    assert zero["types"] == expected_types  # the model's values, lazily at stage 3
    assert ddp["types"] == ["Tensor"]
    if options["stage"] == 3:  # counted elements: handing out reads nothing; reading every entry keeps a bounded part
        before, after, sizes = zero["kept"]
        assert before == 0
        assert 0 < after <= (sizes["bucket"] if full else sizes["rows"]) < sizes["model"], zero["kept"]
    rtol, atol = TOLERANCE[precision]
    assert zero["norms"].keys() == ddp["norms"].keys()
    for key, norm in ddp["norms"].items():  # the hook read every entry's true values
        assert zero["norms"][key] == pytest.approx(norm, rel=rtol, abs=atol), key
    saved, expected = zero["saved"], ddp["saved"]
    assert saved.keys() == expected.keys()  # renamed, dropped and added as the hooks left them
    assert "frozen" not in saved
    assert "extra.scale" in saved
    assert "renamed.model.wpe.weight" in saved
    for key, value in zero["left"].items():  # the tensors the hooks put there, exactly
        assert saved[key].dtype == value.dtype or not full, key
        torch.testing.assert_close(saved[key].float(), value.float(), rtol=0, atol=0, msg=key)
    for key, value in expected.items():  # DDP's (under bf16, ZeRO keeps bf16 parameters and fp32 masters: close)
        torch.testing.assert_close(saved[key].float(), value.float(), rtol=rtol, atol=atol, msg=key)
    if full:  # one file as DDP's, the model's entries in fp32 (the tensors the hooks put there in theirs, above)
        assert all(saved[k].dtype == v.dtype for k, v in expected.items() if k not in zero["left"])
    else:  # the sharded checkpoint records what the hooks left: the cast's dtype; masters only for entries as handed
        _state, toc, _, _ = open_committed(locate(root / "zero" / f"step={runs.STEPS}.ckpt"))
        half = toc["state_dict"]["model.blocks.0.attn.qkv.weight"]
        assert toc["tensors"][half]["dtype"] == "float16"
        masters = toc["masters"]
        ema = [toc["state_dict"][k] for k in ("model.wte.weight", "model.blocks.0.ln_1.weight")]
        assert not any(storage in masters for storage in ema), "an EMA's values load as they are, not the master's"
        if precision == "bf16-mixed":  # bf16 parameters and fp32 masters: the renamed entry keeps its master
            assert masters[toc["state_dict"]["renamed.model.wpe.weight"]] == "master/model.wpe.weight"


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"stage": 3, "exclude_frozen_parameters": True}, id="stage3-exclude-frozen"),
        pytest.param({"stage": 1, "state_dict_type": "full"}, id="stage1-full", marks=pytest.mark.slow),
    ],
)
def test_save_hooks_on_a_peft_lora_llama_keep_the_adapters_as_under_ddp(tmp_path, options):
    from transformers import LlamaForCausalLM

    from tests.test_adapter_checkpoint import BASE
    from tests.test_pretrained_weights import llama_config

    torch.manual_seed(7)
    LlamaForCausalLM(llama_config(**BASE)).save_pretrained(tmp_path / "hf")
    model = functools.partial(_lora, str(tmp_path / "hf"))
    results = run_distributed(
        _save_both, 2, str(tmp_path), options, "32-true", model, init_process_group=False, timeout=280
    )[0]
    ddp, zero = results["ddp"], results["zero"]
    assert zero["saved"].keys() == ddp["saved"].keys()
    assert not any("base_layer" in k for k in zero["saved"])  # the hook dropped the frozen base
    assert any(k.startswith("renamed.") for k in zero["saved"])
    assert "extra.scale" in zero["saved"]
    for key, value in ddp["saved"].items():
        torch.testing.assert_close(zero["saved"][key].float(), value.float(), rtol=1e-5, atol=1e-6, msg=key)
    for key, norm in ddp["norms"].items():
        assert zero["norms"][key] == pytest.approx(norm, rel=1e-5, abs=1e-6), key
    if options.get("exclude_frozen_parameters"):  # the keys the hook dropped are recorded as left out
        state, _, _, _ = open_committed(locate(tmp_path / "zero" / f"step={runs.STEPS}.ckpt"))
        excluded = state[FROZEN_KEY]["excluded"]
        assert excluded, "the frozen base is recorded"
        assert all("lora_" not in k and k not in zero["saved"] for k in excluded)


def _refusals_and_rank_zero(root: str) -> list[Any]:
    refusals = [runs.in_place_refused({"stage": stage}, f"{root}/{stage}") for stage in (1, 3)]
    return [*refusals, runs.rank_zero_edits("ddp", root), runs.rank_zero_edits("zero", root)]


@pytest.mark.timeout(120)
def test_in_place_writes_are_refused_before_anything_is_written_and_rank_zero_edits_are_saved_as_ddps(tmp_path):
    results = run_distributed(_refusals_and_rank_zero, 2, str(tmp_path), init_process_group=False, timeout=100)
    ddp, zero = results[0][2:]  # a hook under rank_zero_only: the file follows rank 0's dictionary, as DDP's
    assert zero.keys() == ddp.keys()
    assert "frozen" not in zero
    assert "renamed.wpe" in zero
    for key, value in ddp.items():
        torch.testing.assert_close(zero[key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert torch.equal(zero["model.ln_f.weight"], torch.full_like(zero["model.ln_f.weight"], 0.25))
    for stage_1, stage_3, *_ in results:
        for refused in (stage_1, stage_3):
            assert refused["written"] == [], "nothing was written"
            assert "in place" in refused["error"], refused["error"]
            assert "HINT: replace the entry" in refused["error"]
        assert stage_1["error"].startswith("CheckpointError")
        assert "live tensor" in stage_1["error"]
        assert stage_3["error"].startswith("RuntimeError: aten.mul_")  # at the operation itself


def _resume_both(root: str, options: dict[str, Any]) -> dict[str, Any]:
    return {name: runs.resume_renamed(name, options, root) for name in ("ddp", "zero")}


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"stage": 3}, id="stage3"),
        pytest.param({"stage": 3, "state_dict_type": "full"}, id="stage3-full"),
        pytest.param({"stage": 1}, id="stage1", marks=pytest.mark.slow),
        pytest.param({"stage": 2, "offload_optimizer": "cpu"}, id="stage2-cpu-tier", marks=pytest.mark.slow),
    ],
)
def test_on_load_checkpoint_maps_a_renamed_modules_keys_and_resumes_as_ddp_and_uninterrupted(tmp_path, options):
    results = run_distributed(_resume_both, 2, str(tmp_path), options, init_process_group=False, timeout=220)
    for rank in results:
        ddp, zero = rank["ddp"], rank["zero"]
        assert zero["losses"] == pytest.approx(ddp["losses"], rel=1e-5)
        assert zero["resumed"] == pytest.approx(zero["losses"][2:], rel=0, abs=0)  # exact: the hooks change nothing
        assert zero["resumed"] == pytest.approx(ddp["resumed"], rel=1e-5)
        for key, value in zero["final"].items():  # the renamed module continued from the mapped weights, exactly
            renamed = "net." + key.removeprefix("model.") if key.startswith("model.") else key
            torch.testing.assert_close(zero["final_resumed"][renamed], value, rtol=0, atol=0, msg=key)
        for saved_ddp, saved_zero in zip(ddp["norms"], zero["norms"], strict=True):  # read at each save
            assert saved_zero == pytest.approx(saved_ddp, rel=1e-5, abs=1e-6)
        assert ddp["refused"] is not None
        assert "Missing key(s)" in ddp["refused"]
        assert zero["refused"] is not None
        assert "16 key(s) missing" in zero["refused"], zero["refused"]
        assert "strict_loading = False" in zero["refused"]
        for key, value in ddp["replaced"].items():  # a tensor the hook put there loads as it is (and its Adam state
            torch.testing.assert_close(
                zero["replaced"][key], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}"
            )  # steps on)
        assert torch.equal(zero["replaced"]["net.ln_f.weight"], ddp["replaced"]["net.ln_f.weight"])
        assert isinstance(ddp["new"], dict)
        if options.get("state_dict_type") == "full":  # one file: the optimizer state loads by position, as DDP's
            for key, value in ddp["new"].items():
                torch.testing.assert_close(zero["new"][key], value, rtol=1e-5, atol=1e-6, msg=key)
        else:  # keyed by name: nothing says whose state it is, so refused before anything loads
            assert "CheckpointError" in zero["new"], zero["new"]
            assert "['net.ln_f.weight'], which has no optimizer state" in zero["new"]
            assert "HINT: write the new values into the moved entry in place" in zero["new"]
        for key, value in ddp["validated"].items():  # under validate's inference mode, the hook reading the entry
            torch.testing.assert_close(zero["validated"][key], value, rtol=1e-5, atol=1e-6, msg=key)
        assert ddp["rank_zero_refused"] is None
        assert "CheckpointError" in zero["rank_zero_refused"], zero["rank_zero_refused"]
        assert "different checkpoint['state_dict'] on rank(s) [1]" in zero["rank_zero_refused"]
        if zero["loaded"] is not None:  # state_dict_type="full": LightningModule.load_from_checkpoint, rank 0
            for key, value in ddp["loaded"].items():
                torch.testing.assert_close(zero["loaded"][key], value, rtol=1e-5, atol=1e-6, msg=key)


def _fabric_both(root: str) -> dict[str, Any]:
    return {name: runs.fabric_stateful(name, root) for name in ("ddp", "zero")}


@pytest.mark.timeout(120)
def test_a_fabric_stateful_object_holding_dtensors_is_saved_and_loaded_whole_as_under_ddp(tmp_path):
    results = run_distributed(_fabric_both, 2, str(tmp_path), init_process_group=False, timeout=100)[0]
    ddp, zero = results["ddp"], results["zero"]
    assert ddp["types"] == zero["types"] == ["Tensor"]  # the full average, not rank 0's rows
    assert zero["ema"].keys() == ddp["ema"].keys()
    for key, value in ddp["ema"].items():
        torch.testing.assert_close(zero["ema"][key], value, rtol=1e-5, atol=1e-6, msg=key)
