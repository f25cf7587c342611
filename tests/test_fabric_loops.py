"""Fabric training loops as public Fabric projects write them (``tests/fabric_loop_runs.py``), unchanged under
``Fabric(strategy="zero*")``, give Fabric DDP's numbers; a resumed run gives the uninterrupted run's."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from tests.fabric_loop_runs import Pretrain, compiled_runs, finetune_runs, nanogpt_runs, pretrain_runs, state_dict_saves
from tests.harness import run_distributed
from tests.test_precision import BF16_LOSS_RTOL

ADAM_STEP_BOUND = 4 * 4e-3
"""4 AdamW steps at a peak learning rate of 4e-3: the most one element can move (Adam's update is at most about the
learning rate), the bound for an element whose tiny gradient bf16 rounds to the other sign."""


def _tail(values: list, run: list) -> list:
    return values[len(values) - len(run) :]


def _assert_pretrain_matches(reference: Pretrain, run: Pretrain, precision: str) -> None:
    """``run`` (uninterrupted, or resumed: its tail) against DDP's: fp32 within 1e-5; bf16 within the bf16 tests'
    loss tolerance, the weights within AdamW's bound and close on average."""
    assert run.dtypes == reference.dtypes  # what the model returns, as Fabric's plugins return it
    assert run.samples == _tail(reference.samples, run.samples)
    assert run.state == reference.state
    fp32 = precision == "32-true"
    close = {"rtol": 1e-5, "atol": 1e-6} if fp32 else {"rtol": BF16_LOSS_RTOL[precision], "atol": 0.0}
    for values, expected in [
        (run.losses, reference.losses),
        (run.reduced, reference.reduced),
        (run.val, reference.val),
    ]:
        torch.testing.assert_close(torch.tensor(values), torch.tensor(_tail(expected, values)), **close)
    _assert_weights_match(reference.weights, run.weights, precision)


def _assert_weights_match(reference: dict[str, Tensor], weights: dict[str, Tensor], precision: str) -> None:
    """fp32: within 1e-5; bf16: within AdamW's bound, and close on average."""
    assert weights.keys() == reference.keys()
    for name, expected in reference.items():
        if precision == "32-true":
            torch.testing.assert_close(weights[name], expected, rtol=1e-5, atol=1e-6, msg=name)
        else:
            difference = (weights[name] - expected).abs()
            assert difference.max() <= ADAM_STEP_BOUND, name
            assert difference.mean() <= 2**-7 * expected.abs().mean(), (name, difference.mean())


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("stage", "precision"), [(3, "32-true"), (2, "bf16-mixed"), (3, "bf16-true")], ids=lambda v: str(v)
)
def test_litgpt_style_pretraining_loop_matches_fabric_ddp_and_resumes_exactly(stage, precision, tmp_path):
    runs = run_distributed(pretrain_runs, 2, stage, str(tmp_path), precision, init_process_group=False, timeout=140)
    for rank, (reference, uninterrupted, resumed) in enumerate(runs):
        _assert_pretrain_matches(reference, uninterrupted, precision)
        _assert_pretrain_matches(reference, resumed, precision)
        assert len(resumed.losses) == 4  # resumed at step 2 of 4 (iteration 4 of 8)
        assert resumed.losses == uninterrupted.losses[4:]  # the resume is exact, in every precision
        for name, expected in uninterrupted.weights.items():
            assert torch.equal(resumed.weights[name], expected), name
        if rank == 0:
            assert [s for s, _ in uninterrupted.logged] == [s for s, _ in reference.logged] == [4, 8]


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("stage", "precision", "load"),
    [(2, "32-true", "load_raw"), (3, "32-true", "load_raw"), (3, "bf16-true", "load_state_dict")],
    ids=str,
)
def test_litgpt_style_lora_finetuning_loop_matches_fabric_ddp(stage, precision, load, tmp_path):
    runs = run_distributed(
        finetune_runs, 2, stage, str(tmp_path), precision, False, load, init_process_group=False, timeout=140
    )
    close = {"rtol": 1e-5, "atol": 1e-6} if precision == "32-true" else {"rtol": BF16_LOSS_RTOL[precision], "atol": 0.0}
    for reference, run in runs:
        assert run.trainable == reference.trainable
        assert all("lora_" in n for n in run.trainable)
        assert run.samples == reference.samples
        assert run.lrs == reference.lrs
        for values, expected in [(run.losses, reference.losses), (run.val, reference.val)]:
            torch.testing.assert_close(torch.tensor(values), torch.tensor(expected), **close)
        _assert_weights_match(reference.weights, run.weights, precision)
    for step in ("step-000002", "step-000004"):  # the filtered adapter saves (tests/test_fabric_checkpoint reads one)
        assert (tmp_path / "ZeroFabricStrategy" / step / "lit_model.pth.lora" / "lightning_state.pt").is_file()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("load", ["load_raw", "load_state_dict"])
def test_litgpt_style_lora_finetuning_on_meta_loads_the_base_and_starts_from_it(load, tmp_path):
    """LitGPT's ``empty_init=(world_size > 1)`` at stage 3: the base is built on meta, materialized, then overwritten
    by ``load_raw(strict=False)`` or ``model.load_state_dict(strict=False)`` (Note [load_state_dict into shards]);
    the adapters get peft's initialization (Note [peft adapters on meta]), other draws
    than DDP's, with ``lora_B`` zero: the first loss is the pretrained base's, as under DDP."""
    for reference, run in run_distributed(
        finetune_runs, 2, 3, str(tmp_path), "32-true", True, init_process_group=False
    ):
        torch.testing.assert_close(run.losses[0], reference.losses[0], rtol=1e-5, atol=1e-6)
        frozen = [n for n in reference.weights if n not in run.trainable]
        assert len(frozen) > 2 * len(run.trainable)
        for name in frozen:
            torch.testing.assert_close(run.weights[name], reference.weights[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("stage", "precision"), [(3, "32-true"), (1, "bf16-mixed")], ids=lambda v: str(v))
def test_nanogpt_style_loop_with_ranks_seeded_apart_and_marked_forward_methods_matches_fabric_ddp(stage, precision):
    runs = run_distributed(nanogpt_runs, 2, stage, precision, init_process_group=False, timeout=110)
    fp32 = precision == "32-true"
    close = {"rtol": 1e-5, "atol": 1e-6} if fp32 else {"rtol": BF16_LOSS_RTOL[precision], "atol": 0.0}
    for reference, run in runs:
        scores, expected_scores = run.extra.pop("scores"), reference.extra.pop("scores")
        torch.testing.assert_close(scores, expected_scores, **close)  # a marked method reading a parameter itself
        assert run.extra == reference.extra  # what the marked method returns, as under DDP
        assert run.samples == reference.samples
        torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(reference.losses), **close)
        torch.testing.assert_close(torch.tensor(run.evals), torch.tensor(reference.evals), **close)
        _assert_weights_match(reference.weights, run.weights, precision)


@pytest.mark.timeout(60)
def test_a_stage3_state_dict_saved_by_fabric_holds_the_weights_and_an_unmarked_method_is_refused(tmp_path):
    """lit-llama's ``fabric.save(path, {"weights": model.state_dict()})``: outside a gather (DTensors, saved whole)
    and inside one (copies) the file holds the weights; the parameters themselves are refused (placeholders)."""
    results = run_distributed(state_dict_saves, 2, str(tmp_path), init_process_group=False, timeout=50)
    for where in ("outside.pth", "gathered.pth"):
        saved = torch.load(tmp_path / where / "lightning_state.pt", weights_only=True)["weights"]
        for result in results:
            assert "mark_forward_method('score')" in result["unmarked"]  # Fabric's own error, as under DDP
            assert "placeholders" in result["refused"]
            assert "model.state_dict()" in result["refused"]  # the fix
            assert saved.keys() == result["weights"].keys()
            for name, expected in result["weights"].items():
                assert torch.equal(saved[name], expected), (where, name)
                assert not saved[name].isnan().any(), name
    assert not (tmp_path / "parameters.pth").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_model_compiled_before_setup_matches_fabric_ddp_at_stage_3():
    for reference, losses in run_distributed(compiled_runs, 2, 3, init_process_group=False, timeout=290):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-5, atol=1e-6)
