"""Several models in one Fabric under ZeRO, as Fabric's documentation and examples use them (a GAN with two models
and two optimizers, distillation from a frozen teacher, a policy and a value network), against Fabric's DDP step by
step; their checkpoints in one sharded directory, resumed at another stage, and loaded in parts as Fabric's DDP
loads them."""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_zero import ZeroFabricStrategy
from lightning_zero.checkpoint.files import LIGHTNING_STATE_FILE
from lightning_zero.compat import checkpoint_wrapper
from lightning_zero.sharding.activation_checkpointing import apply_activation_checkpointing_policy
from tests.fabric_model_runs import (
    Discriminator,
    Generator,
    ddp_and_zero,
    gan_resume,
    gan_setup,
    gan_with_the_trainer,
    partial_loads_under_ddp_and_zero,
)
from tests.fabric_runs import make_fabric
from tests.harness import run_distributed
from tests.parity import assert_runs_match
from tests.test_precision import BF16_LOSS_RTOL, BF16_WEIGHT_ATOL, BF16_WEIGHT_RTOL

OPTIMIZERS = ("optimizer_g", "optimizer_d")
MODELS = ("generator", "discriminator")


ADAM_BF16_WEIGHT_ATOL = 3 * 2e-3
"""The GAN's weights in bf16-mixed: Adam moves a weight by up to its learning rate (2e-3) per step whatever the
gradient's size, so bf16-rounded gradients may move it differently by that much each of the 3 steps (measured: at
most 3.4e-3 at stages 2 and 3)."""


def _assert_match(reference: Any, sharded: Any, precision: str, loop: str = "") -> None:
    if precision == "32-true":
        assert_runs_match(reference, sharded)
        if reference.extra.get("norms"):
            torch.testing.assert_close(torch.tensor(sharded.extra["norms"]), torch.tensor(reference.extra["norms"]))
        return
    torch.testing.assert_close(
        torch.tensor(sharded.losses), torch.tensor(reference.losses), rtol=BF16_LOSS_RTOL[precision], atol=0
    )
    for name, expected in reference.weights.items():
        torch.testing.assert_close(
            sharded.weights[name],
            expected.bfloat16().float(),
            rtol=BF16_WEIGHT_RTOL,
            atol=ADAM_BF16_WEIGHT_ATOL if loop == "gan" else BF16_WEIGHT_ATOL,
            msg=name,
        )


@pytest.mark.timeout(150)
def test_dcgan_distillation_and_policy_value_loops_match_fabric_ddp_step_by_step():
    """The DCGAN example's loop (each model zeroed with its own ``zero_grad()``, the discriminator also getting the
    generator loss's gradient, which that ``zero_grad()`` drops) at stages 2 and 3, and in bf16-mixed; a student
    with a frozen teacher set up beside it, accumulating and clipped; a policy and a value network set up one by one
    with their optimizers in one call, accumulating under both models' ``no_backward_sync``, with the host tier."""
    cases = [
        ("gan", {"stage": 2}, "32-true"),
        ("gan", {"stage": 3}, "32-true"),
        ("gan", {"stage": 3}, "bf16-mixed"),
        ("distill", {"stage": 3, "bucket_numel": 300}, "32-true"),
        ("policy_value", {"stage": 2, "offload_optimizer": "cpu"}, "32-true"),
    ]
    results = run_distributed(ddp_and_zero, 2, cases, init_process_group=False, timeout=140)
    for runs in results:
        for (reference, sharded), (loop, _, precision) in zip(runs, cases, strict=True):
            _assert_match(reference, sharded, precision, loop)
            assert len(reference.weights) > 4, loop  # both models' weights are compared
    gan_losses = results[0][0][0].losses
    assert len(set(gan_losses)) == len(gan_losses)  # the models trained
    assert max(results[0][3][0].extra["norms"]) > 0.02  # the student's clipping clipped


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_same_loops_at_stage_one_and_the_others_at_the_other_stages_and_tiers():
    cases = [
        ("gan", {"stage": 1}, "32-true"),
        ("gan", {"stage": 2, "offload_optimizer": "cpu"}, "32-true"),
        ("gan", {"stage": 2}, "bf16-mixed"),
        ("distill", {"stage": 2}, "32-true"),
        ("distill", {"stage": 3}, "bf16-mixed"),
        ("policy_value", {"stage": 3}, "32-true"),
        ("policy_value", {"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"}, "32-true"),
        ("policy_value", {"stage": 1}, "32-true"),
    ]
    for runs in run_distributed(ddp_and_zero, 2, cases, init_process_group=False, timeout=290):
        for (reference, sharded), (loop, _, precision) in zip(runs, cases, strict=True):
            _assert_match(reference, sharded, precision, loop)


# -- checkpoints ------------------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_a_gan_checkpoint_holds_both_models_in_one_directory_and_resumes_exactly_at_another_stage():
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(gan_resume, 2, root, {"stage": 3}, {"stage": 2}, init_process_group=False)
        saved = torch.load(Path(root, "gan", LIGHTNING_STATE_FILE), weights_only=True)
    keys = saved["lightning_zero"]["state_dict"]
    assert {k.split(".")[0] for k in keys} == set(MODELS)  # each model in its section, named as Fabric named it
    assert saved["fabric_names"]["optimizers"] == ["optimizer_d", "optimizer_g"]  # as they were set up
    assert saved["fabric_names"]["sections"] == ["discriminator.", "generator."]
    for result in results:
        uninterrupted, resumed = result["losses"]
        assert resumed == uninterrupted  # the losses and weights of the run that was not interrupted, exactly
        for name, expected in result["final"][0].items():
            assert torch.equal(result["final"][1][name], expected), name
        for name, expected in results[0]["saved"].items():  # buffers as rank 0 held them, as in DDP's checkpoint
            assert torch.equal(result["loaded"][name], expected), name
        assert result["remainder"] == {}
        for name, expected in result["teacher"][0].items():  # a module not set up, as Fabric's DDP saves it
            assert torch.equal(result["teacher"][1][name], expected), name


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_gan_checkpoint_resumes_a_trainer_holding_both_models_and_a_trainer_checkpoint_loads_into_both():
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(gan_with_the_trainer, 2, root, init_process_group=False, timeout=230)
    names = {"0": "generator", "1": "discriminator"}
    saved = results[0]["saved"]  # buffers as rank 0 held them, as in DDP's checkpoint
    for result in results:
        for key, value in saved.items():
            index, rest = key.split(".", 1)
            if f"{names[index]}.{rest}" in result["trainer"]:  # its parameters, at the start of fit
                assert torch.equal(result["trainer"][f"{names[index]}.{rest}"], value), key
            assert torch.equal(result["fabric"][key], value), key  # back from the Trainer's checkpoint
        assert len(result["trainer"]) == sum("running" not in k and "num_batches" not in k for k in saved)


@pytest.mark.timeout(150)
def test_parts_of_a_checkpoint_load_as_under_fabric_ddp():
    """Only one optimizer, only the user's objects, one model and a module not set up, a key the checkpoint lacks
    (refused with Fabric's message, then allowed with ``strict=False``), no state at all: each restores what Fabric's
    DDP restores, and the step after it computes the same losses. What comes back is the rest of what was saved, as
    Fabric's strategies return it (a sharded checkpoint, like FSDP's, returns the entries that are not set-up models
    or optimizers)."""

    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(partial_loads_under_ddp_and_zero, 2, root, init_process_group=False, timeout=140)
    set_up = {*MODELS, *OPTIMIZERS}
    for ddp, zero in results:
        for case in ("optimizer_d", "generator", "not_strict"):
            expected_rest, zero_rest = ddp[case][0], zero[case][0]
            assert sorted(zero_rest) == sorted(k for k in expected_rest if k not in set_up), case
            torch.testing.assert_close(torch.tensor(zero[case][-1]), torch.tensor(ddp[case][-1]), msg=case)
        assert ddp["optimizer_d"][1] != ddp["user"][2]  # the optimizer state changed the step
        remainder, state, losses = zero["user"]
        assert state == {"step": 2, "note": "two steps"} == ddp["user"][1]
        assert sorted(remainder) == ["teacher"]
        assert losses == pytest.approx(ddp["user"][2], rel=1e-5)
        for name, value in ddp["loaded_teacher"].items():
            assert torch.equal(zero["loaded_teacher"][name], value)
            assert torch.equal(zero["teacher"][name], zero["loaded_teacher"][name])
        assert "The requested state contains a key 'coconut' that does not exist" in zero["strict"] == ddp["strict"]
        assert zero["not_strict"][1] == 11
        assert zero["everything"] == sorted(k for k in ddp["everything"] if k not in set_up)


# -- what is refused, before anything is written ---------------------------------------------------------------------
def _refusals(root: str) -> dict[str, str]:
    errors = {}
    fabric = make_fabric(ZeroFabricStrategy(stage=3, state_dict_type="full"))
    parts = gan_setup(fabric)
    try:
        fabric.save(f"{root}/full.pt", {"generator": parts[0], "discriminator": parts[1]})
    except ValueError as error:
        errors["full"] = str(error)
    fabric.save(f"{root}/generator.pt", {"generator": parts[0], "optimizer_g": parts[2], "step": 1})
    generator = Generator()
    generator.load_state_dict(torch.load(f"{root}/generator.pt", weights_only=True)["generator"])
    errors["one file"] = str(sorted(torch.load(f"{root}/generator.pt", weights_only=True)))
    both = torch.optim.SGD([*parts[0].parameters(), *parts[1].parameters()], lr=0.1)
    try:
        fabric.setup_optimizers(both)
    except ValueError as error:
        errors["spanning"] = str(error)
    fabric = make_fabric(ZeroFabricStrategy(stage=2, exclude_frozen_parameters=True))
    fabric.setup_module(Generator())
    try:
        fabric.setup_module(Discriminator())
    except ValueError as error:
        errors["frozen"] = str(error)
    return errors


@pytest.mark.timeout(90)
def test_what_cannot_be_saved_or_set_up_is_refused_before_anything_is_written(tmp_path):
    root = str(tmp_path)
    for errors in run_distributed(_refusals, 2, root, init_process_group=False):
        assert "state_dict_type='full' writes one set-up model" in errors["full"]
        assert "['generator', 'discriminator']" in errors["full"]
        assert errors["one file"] == "['generator', 'optimizer_g', 'step']"
        assert "holds parameters of several set-up models (Discriminator and Generator)" in errors["spanning"]
        assert "exclude_frozen_parameters=True records one pretrained source" in errors["frozen"]
    assert not Path(root, "full.pt").exists()


# -- without a process group -----------------------------------------------------------------------------------------
def test_a_model_holding_its_own_checkpoint_wrappers_is_warned_about_and_left_as_it_is():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    model[0] = checkpoint_wrapper(model[0])  # the layer the policy selects, wrapped by the user
    with pytest.warns(UserWarning, match=r"already holds checkpointed layers \(1, e\.g\. Linear\)"):
        assert apply_activation_checkpointing_policy(model, (nn.Linear,)) == 0
    plain = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    assert apply_activation_checkpointing_policy(plain, (nn.Linear,)) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the policy's own wrappers: a second setup of the same model, silently
        assert apply_activation_checkpointing_policy(plain, (nn.Linear,)) == 0


def test_16_true_is_refused_naming_the_fabric_strategy():
    expected = r"ZeroFabricStrategy does not support the precision plugin HalfPrecision \(precision='16-true'\)"
    with pytest.raises(ValueError, match=expected + r".*HINT: use Fabric\(precision=...\)"):
        Fabric(strategy="zero2", accelerator="cpu", devices=1, precision="16-true")
