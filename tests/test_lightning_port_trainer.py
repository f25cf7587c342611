"""Lightning's own Trainer strategy and checkpoint tests, ported to ``ZeroStrategy``: the contract Lightning's DDP,
FSDP, DeepSpeed and ModelParallel strategies are held to (``tests_pytorch/strategies/test_fsdp.py``,
``test_ddp_integration.py``, ``test_deepspeed.py``, ``test_model_parallel_integration.py``, ``checkpointing/``,
``trainer/connectors/test_checkpoint_connector.py``), at stages 2 and 3 on 2 gloo ranks, against Lightning's DDP
wherever there are numbers. The cases run in one set of processes (``lightning_port_trainer_runs``): each test reads
its case. Where ZeRO refuses what DDP does, the test asserts the refusal and says why Lightning's contract allows it.
A rank killed in the middle of a save, then a resume from ``last``: one cycle here, several behind ``--runslow``."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch

from tests.harness import DistributedTestError, run_distributed
from tests.lightning_port_trainer_runs import (
    STRATEGIES,
    battery,
    killed_in_a_save,
    resumed_from_last,
    spawn_fit,
    uninterrupted,
)
from tests.test_checkpoint_trainer import assert_same

ZERO = [name for name in STRATEGIES if name != "ddp"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("lightning_port_trainer")
    return run_distributed(battery, 2, str(root), init_process_group=False, timeout=280)


def case(results: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """Each rank's ``{strategy: result}`` for case ``name``; a strategy that raised fails the test with its trace."""
    for rank, per_rank in enumerate(results):
        for strategy, result in per_rank[name].items():
            if isinstance(result, str):
                pytest.fail(f"{name} under {strategy} raised on rank {rank}:\n{result}")
    return [per_rank[name] for per_rank in results]


def close(actual: Any, expected: Any, exact: bool = False) -> None:
    tolerance = {"rtol": 0.0, "atol": 0.0} if exact else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(actual, expected, **tolerance)


# -- fit, validate, test, predict, fit again, resume "last", ModelCheckpoint's top-k -------------------------------
@pytest.mark.timeout(400)
def test_fit_validate_test_predict_and_fit_again_give_ddp_numbers_with_the_model_built_in_configure_model(results):
    """One ``fit`` (the model built in ``configure_model``, on meta at stage 3; a ``torchmetrics`` metric logged
    in validation), ``validate``, ``test`` of the module and of ``ckpt_path="best"``, ``predict``, and ``fit`` again
    on the same Trainer with more steps: DDP's losses, metrics, predictions and weights at every point."""
    for per_rank in case(results, "lifecycle"):
        reference = per_rank["ddp"]
        assert reference["fit"]["on_meta"] is False
        for name in ZERO:
            run = per_rank[name]
            assert run["fit"]["on_meta"] is (name == "zero3")
            for key in ("losses", "weights", "metrics"):
                close(run["fit"][key], reference["fit"][key])
            assert set(run["fit"]["metrics"]) == {"train_loss", "val_loss", "val_mse"}
            for key in ("validate", "test", "test_best", "predict", "final_validate"):
                close(run[key], reference[key])
            close(run["fit_again"], reference["fit_again"])
            assert len(run["fit_again"]["losses"]) == 6


def test_model_checkpoint_keeps_the_top_k_and_last_and_a_new_trainer_resumes_last(results):
    """``ModelCheckpoint(save_top_k=2, save_last=True)`` with a checkpoint per step: the directory holds exactly the
    best two and ``last`` (every removal complete, nothing hidden left), as under DDP; a new Trainer with a fresh
    module resumes ``ckpt_path="last"`` to DDP's numbers, calling ``configure_model`` once."""
    for per_rank in case(results, "lifecycle"):
        reference = per_rank["ddp"]
        for name in ZERO:
            run = per_rank[name]
            assert run["fit"]["listing"] == reference["fit"]["listing"] == [*run["fit"]["kept"], "last.ckpt"]
            assert run["fit"]["best"] == reference["fit"]["best"]
            assert run["fit"]["kept"] == reference["fit"]["kept"]
            assert run["resumed"]["listing"] == reference["resumed"]["listing"]
            assert run["resumed"]["global_step"] == 8
            assert run["resumed"]["configure_calls"] == 1
            close(run["resumed"]["losses"], reference["resumed"]["losses"])
            close(run["resumed"]["weights"], reference["resumed"]["weights"])


def test_state_dict_and_load_state_dict_of_the_lightning_module_are_ddps(results):
    """``strategy.lightning_module_state_dict()`` and ``LightningModule.state_dict()`` give DDP's values (at stage 3
    DTensor rows, FSDP2's contract; ``lightning_module_state_dict()`` used to give the checkpoint's internal chunks),
    and ``load_state_dict()`` of DDP's final weights into the trained model validates as DDP does."""
    for per_rank in case(results, "lifecycle"):
        reference = per_rank["ddp"]
        for name in ZERO:
            run = per_rank[name]
            expected_types = ["DTensor"] if name == "zero3" else ["Tensor"]
            assert run["state_dict_types"] == expected_types
            assert run["strategy_state_types"] == expected_types
            close(run["state_dict"], reference["state_dict"])
            close(run["strategy_state"], reference["state_dict"])
            close(run["weights_after_load"], reference["resumed"]["weights"], exact=True)
            close(run["validate_ddp_weights"], reference["final_validate"])


def test_a_new_trainer_without_a_checkpoint_takes_the_model_over(results):
    for per_rank in case(results, "lifecycle"):
        reference = per_rank["ddp"]
        for name in ZERO:
            close(per_rank[name]["taken_over_validate"], reference["taken_over_validate"])
            close(per_rank[name]["taken_over"], reference["taken_over"])


# -- save_checkpoint(weights_only=True), load_from_checkpoint, test/predict from a path under inference_mode ---------
def test_weights_only_full_checkpoint_loads_with_load_from_checkpoint_and_serves_test_and_predict(results):
    """Lightning's FSDP ``_run_multiple_stages`` with ``state_dict_type="full"``: on rank 0
    ``load_from_checkpoint`` gives ``lightning_module_state_dict()``'s tensors (the other ranks get none, as under
    FSDP); ``test`` and ``predict`` of the module and of the path under ``torch.inference_mode()`` are DDP's."""
    for rank, per_rank in enumerate(case(results, "multiple_stages")):
        reference = per_rank["ddp"]
        for name in ZERO:
            run = per_rank[name]
            if rank == 0:
                assert run["full_keys"] == reference["full_keys"]
                close(run["loaded"], run["full"], exact=True)
                close(run["full"], reference["full"])
            else:
                assert run["full_keys"] is None
            for key in ("test", "test_path", "predict", "predict_path"):
                close(run[key], reference[key])


def test_weights_only_sharded_checkpoint_serves_test_and_predict_and_load_from_checkpoint_names_the_directory(
    results,
):
    """The default sharded format is a directory: ``test``/``predict`` from its path work under
    ``torch.inference_mode()``; ``LightningModule.load_from_checkpoint`` reads one file and raises torch's
    ``IsADirectoryError``, as it does for FSDP's and DeepSpeed's sharded directories (``python -m lightning_zero
    consolidate`` writes the file, as Lightning's ``consolidate_checkpoint`` does for FSDP)."""
    # The same module, data and steps as multiple_stages: DDP's numbers are that case's.
    for per_rank, stages in zip(case(results, "sharded_weights_only"), case(results, "multiple_stages"), strict=True):
        for name in ZERO:
            run = per_rank[name]
            assert run["is_dir"]
            assert run["load_from_checkpoint"].startswith("IsADirectoryError"), run["load_from_checkpoint"]
            close(run["test_path"], stages["ddp"]["test_path"])
            close(run["predict_path"], stages["ddp"]["predict_path"])


# -- strict_loading, manual optimization ---------------------------------------------------------------------------
def test_strict_loading_false_resumes_a_module_with_a_new_layer_and_true_refuses_it(results):
    """Lightning's ``test_strict_loading``: with ``strict_loading = False`` a checkpoint without the new layer
    resumes the module (the layer keeps its initialization) to DDP's numbers; left on, the resume is refused with a
    ``RuntimeError`` naming the missing keys, as torch's ``load_state_dict`` refuses it under DDP (ZeRO's
    ``CheckpointError`` is one)."""
    for per_rank in case(results, "strict_loading"):
        reference = per_rank["ddp"]
        assert reference[True].startswith("RuntimeError")
        for name in ZERO:
            run = per_rank[name]
            assert run[True].startswith("CheckpointError"), run[True]
            assert "['extra.bias', 'extra.weight']" in run[True]
            assert "strict_loading" in run[True]
            close(run["saved"], reference["saved"])
            close(run[False], reference[False])


def test_manual_optimization_with_clipping_matches_ddp(results):
    for per_rank in case(results, "manual_optimization"):
        for name in ZERO:
            close(per_rank[name], per_rank["ddp"])


# -- *_spawn ---------------------------------------------------------------------------------------------------------
@pytest.mark.slow  # four spawned processes that import torch (~3 s each on an idle machine); two siblings cover the
@pytest.mark.timeout(300)  # weights in the default suite (test_strategy.py, test_module_surface.py)
def test_spawn_returns_weights_metrics_and_the_best_checkpoint_to_the_main_process(tmp_path):
    reference = spawn_fit("ddp_spawn", str(tmp_path))
    sharded = spawn_fit("zero3_spawn", str(tmp_path))
    close(sharded["weights"], reference["weights"])
    close(sharded["metrics"], reference["metrics"])
    assert reference["best"].startswith("ddp_spawn/epoch=0-step=")
    assert sharded["best"] == reference["best"].replace("ddp_spawn", "zero3_spawn")


# -- a rank killed in the middle of a save, then a resume from the last committed checkpoint ------------------------
def _kill_and_resume(stage: int, cycles: int) -> None:
    """``cycles`` runs, each resuming ``last`` and losing a rank (0 and 1 in turn: rank 0 holds the store) in its
    second save, after the first committed; then a run to the end. The final weights are those of a run that was
    never interrupted, bit for bit, and nothing the killed saves staged is left in the checkpoint directory."""
    with tempfile.TemporaryDirectory() as root:
        expected = run_distributed(uninterrupted, 2, f"{root}/reference", stage, init_process_group=False)[0]
        for cycle in range(cycles):
            victim = cycle % 2
            with pytest.raises(DistributedTestError) as crash:
                run_distributed(killed_in_a_save, 2, root, stage, victim, 2, init_process_group=False, timeout=90)
            assert "SIGKILL" in crash.value.failures[victim], crash.value.failures
        for result in run_distributed(resumed_from_last, 2, root, stage, init_process_group=False):
            assert result["start"] == 2 * cycles  # each killed run committed one save (2 steps) before dying
            assert_same(result["weights"], expected)
            assert result["listing"] == ["last.ckpt"], result["listing"]
        assert not [p for p in os.listdir(root) if p.startswith(".")]


@pytest.mark.timeout(240)
def test_a_rank_killed_in_a_save_at_stage_3_resumes_from_the_last_committed_checkpoint():
    _kill_and_resume(stage=3, cycles=1)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("stage", [2, 3])
def test_kill_and_resume_soak(stage):
    _kill_and_resume(stage, cycles=int(os.environ.get("LIGHTNING_ZERO_KILL_CYCLES", 4)))
