"""Lightning's own Fabric strategy tests, ported to ``ZeroFabricStrategy``: the contract Fabric's DDP, FSDP and
ModelParallel strategies are held to (``tests_fabric/test_fabric.py``, ``strategies/test_ddp_integration.py``,
``test_fsdp_integration.py``, ``test_model_parallel_integration.py``), at stages 1, 2 and 3 on 2 gloo ranks, against
Fabric's DDP wherever there are numbers. Every case runs in one set of processes (``lightning_port_fabric_runs``):
each test reads its case. Where ZeRO refuses what Fabric's DDP does, the test asserts the refusal and says why
Lightning's contract allows it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.harness import run_distributed
from tests.lightning_port_fabric_runs import STRATEGIES, battery

ZERO = [name for name in STRATEGIES if name != "ddp"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("lightning_port_fabric")
    return run_distributed(battery, 2, str(root), init_process_group=False, timeout=240)


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


# -- test_fabric.py: setup, setup_module + setup_optimizers, several models ------------------------------------------
@pytest.mark.timeout(300)
def test_every_setup_order_trains_as_fabric_ddp_and_a_second_setup_is_refused(results):
    for per_rank in case(results, "setup_orders"):
        reference = per_rank["ddp"]["joint"]
        for name in ZERO:
            for order, run in per_rank[name].items():
                assert run["wrapped"], (name, order)
                assert run["same_module"], (name, order)
                assert run["groups"] == [(2, 0.05), (2, 0.025)], (name, order)  # param groups and lrs kept
                close(run["losses"], reference["losses"])
                close(run["weights"], reference["weights"])
                assert run["refusals"] == reference["refusals"]  # Fabric's ValueError, before the strategy
                assert len(run["refusals"]) == 2
                assert "only once" in run["refusals"][0]
                assert run["models_setup"] == 1


def test_several_models_set_up_one_by_one_train_as_fabric_ddp(results):
    for per_rank in case(results, "several_models"):
        for name in ZERO:
            close(per_rank[name]["losses"], per_rank["ddp"]["losses"])
            close(per_rank[name]["weights"], per_rank["ddp"]["weights"])


# -- init_module ---------------------------------------------------------------------------------------------------
def test_init_module_builds_on_meta_at_stage_3_only_and_setup_gives_every_parameter_its_device_and_dtype(results):
    """As Lightning's ``test_module_init_context`` for FSDP: ``empty_init=True`` builds on meta at stage 3 (and
    the model gets the weights its ``reset_parameters`` give for the same seed), as DDP on the CPU at stages 1 and 2
    (uninitialized, as DDP's); without ``empty_init`` every strategy builds on the CPU with the seed's weights, in
    the precision's dtype."""
    for per_rank in case(results, "init_module"):
        for name in STRATEGIES:
            for (precision, empty_init), run in per_rank[name].items():
                dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
                meta = empty_init and name == "zero3"
                assert run["before"] == ("meta" if meta else "cpu", dtype), (name, precision, empty_init)
                assert run["after"] == [("cpu", dtype)] * 2, (name, precision, empty_init)
                if not empty_init or meta:  # DDP's weights built without empty_init, from the same seed
                    close(run["weights"], per_rank["ddp"][(precision, False)]["weights"], exact=True)


# -- fabric.save / fabric.load -------------------------------------------------------------------------------------
def test_save_then_load_resumes_bit_identically_with_fabric_ddp_numbers(results):
    """Lightning's ``test_train_save_load``: the loaded model and optimizer continue exactly as the run that saved
    them, a plain value comes back, nothing is left over; a name the checkpoint lacks is Fabric's ``KeyError``
    unless ``strict=False``; the model alone loads too."""
    for per_rank in case(results, "save_and_load"):
        reference = per_rank["ddp"]
        for name in STRATEGIES:
            run = per_rank[name]
            close(run["loaded"], run["saved"], exact=True)
            close(run["resumed"], run["continued"], exact=True)
            close(run["continued"], reference["continued"])
            assert run["steps"] == 1
            assert run["remainder"] == {}
            assert run["lrs"] == [0.05, 0.025]
            assert "The requested state contains a key 'coconut' that does not exist" in run["missing_key"]
            assert run["coconut"] == 11
            close(run["model_only"], run["saved"], exact=True)


def test_load_without_a_state_returns_what_is_not_a_model_or_an_optimizer(results):
    """``fabric.load(path)`` with no objects to restore: Fabric's DDP returns the whole file (state dicts
    included), Fabric's FSDP and ModelParallel strategies refuse it (``ValueError``: a sharded state is only read
    into set-up objects). ZeRO's checkpoint is sharded too; it returns the entries that are not a model or an
    optimizer (README, "Fabric"), what FSDP would have restored beside the objects."""
    for per_rank in case(results, "save_and_load"):
        assert set(per_rank["ddp"]["everything_else"]) == {"model", "optimizer", "steps"}
        for name in ZERO:
            assert per_rank[name]["everything_else"] == {"steps": 1}


def test_the_optimizer_state_alone_resumes_the_next_steps(results):
    for per_rank in case(results, "optimizer_only"):
        for name in STRATEGIES:
            close(per_rank[name]["resumed"], per_rank[name]["continued"], exact=True)
            close(per_rank[name]["continued"], per_rank["ddp"]["continued"])


def test_save_filter_keeps_the_accepted_entries_in_one_file_and_in_the_sharded_directory(results):
    """Lightning's ``test_save_filter``: one file keeps only the accepted keys. FSDP refuses ``filter`` with its
    sharded format (``NotImplementedError``); ZeRO's sharded directory keeps the accepted entries, so a strict load
    names the keys it lacks (``CheckpointError``, a ``RuntimeError`` as torch's ``load_state_dict`` raises), and
    ``strict=False`` loads only those."""
    for per_rank in case(results, "save_filter"):
        for name in STRATEGIES:
            assert per_rank[name]["file_keys"] == ["0.bias", "2.bias"], name
        for name in ZERO:
            run = per_rank[name]
            assert run["strict_load"].startswith("CheckpointError"), run["strict_load"]
            assert "missing from the checkpoint ['0.weight', '2.weight']" in run["strict_load"]
            assert "HINT" in run["strict_load"]
            assert run["lenient_load"], run["lenient_load"]
            assert all(run["lenient_load"].values()), run["lenient_load"]


def test_a_model_saved_before_or_after_setup_loads_into_a_plain_and_into_a_set_up_model(results):
    """Lightning's ``test_ddp_save_load``. A model saved set up, loaded into a module that is not, used to be refused
    with a ``KeyError`` saying the checkpoint had no such key: it now loads its weights whole, as under DDP."""
    for per_rank in case(results, "before_and_after_setup"):
        for name in STRATEGIES:
            run = per_rank[name]
            for key, value in run.items():
                if key != "expected":
                    close(value, run["expected"], exact=True)


def test_checkpoints_exchange_with_fabric_ddp_and_load_raw_streams_a_state_dict_file(results):
    """Lightning's ``test_save_full_state_dict`` and ``test_load_full_state_dict_into_sharded_model``: Fabric's DDP
    file loads into ZeRO (model, optimizer, plain values), ZeRO's one file (``state_dict_type="full"``) into Fabric's
    DDP, and each trains on as the run that saved it; ``fabric.load_raw`` of ``model.state_dict()``'s file."""
    for per_rank in case(results, "exchange_with_ddp"):
        for name in ZERO:
            run = per_rank[name]
            assert run["steps"] == 2
            close(run["zero_from_ddp"], run["ddp_continued"])
            close(run["ddp_from_zero"], run["zero_continued"])
            close(run["zero_continued"], run["ddp_continued"])
            assert run["file_keys"] == ["model", "optimizer", "steps"]
            close(run["load_raw"], run["ddp_saved"], exact=True)


# -- no_backward_sync, clipping, collectives -----------------------------------------------------------------------
def test_no_backward_sync_accumulates_as_fabric_ddp_and_needs_a_set_up_model(results):
    for per_rank in case(results, "no_backward_sync"):
        for name in ZERO:
            assert per_rank[name]["refusal"] == per_rank["ddp"]["refusal"]
            assert "You need to set up the model first" in per_rank[name]["refusal"]
            close(per_rank[name]["losses"], per_rank["ddp"]["losses"])
            close(per_rank[name]["weights"], per_rank["ddp"]["weights"])


def test_clipping_by_value_and_by_norm_changes_the_weights_as_fabric_ddp(results):
    """Lightning's ``test_clip_gradients``, read through the weights: every gradient entry is 0.1, clipped to 0.05 by
    value or scaled to a norm of 0.08 (a tenth), and SGD with learning rate 1 subtracts the clipped gradient.

    Lightning's test reads ``.grad`` between ``fabric.backward`` and the step: under ZeRO it shows the averaged
    gradient read from the shards, DDP's value on every rank (Note [gradients between backward and step])."""
    for per_rank in case(results, "clipping"):
        reference = per_rank["ddp"]
        torch.testing.assert_close(reference["value"]["weights"]["0.weight"], torch.full((2, 32), 0.01 - 0.05))
        close(reference["norm"]["weights"]["0.weight"], torch.full((2, 32), 0.0))
        assert reference["norm"]["norm"] == pytest.approx(0.8)
        for name in ZERO:
            for kind in ("value", "norm"):
                close(per_rank[name][kind]["weights"], reference[kind]["weights"])
                close(reference[kind]["grad_after_backward"], torch.full((2, 32), 0.1))
                close(per_rank[name][kind]["grad_after_backward"], reference[kind]["grad_after_backward"])
            assert per_rank[name]["norm"]["norm"] == pytest.approx(0.8)


def test_collectives_match_fabric_ddp_with_a_sharded_model_set_up(results):
    for rank, per_rank in enumerate(case(results, "collectives")):
        reference = per_rank["ddp"]
        assert torch.equal(reference["gathered"], torch.tensor([[0, 0], [1, 10]]))
        assert reference["summed"].item() == 3.0
        assert reference["message"] == {"from": 0, "path": "/tmp/rank0"}
        assert torch.equal(reference["tensor"], torch.arange(3) + 1)
        for name in ZERO:
            run = per_rank[name]
            for key in ("gathered", "summed", "mean", "tensor", "output"):
                close(run[key], reference[key])
            close(run["gathered_dict"], reference["gathered_dict"])
            assert run["message"] == reference["message"], rank
