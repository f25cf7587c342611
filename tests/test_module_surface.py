"""A stage-3 model used through plain ``nn.Module`` calls, as code we did not write uses it, against Fabric's DDP:
``state_dict()`` (DTensors with DDP's values, not placeholders), ``load_state_dict()`` of a lazily loaded file through
the module's own renaming hooks, a state dict taken inside ``gathered_parameters()`` saved after it, and a forward
on one rank only (Note [a stage-3 model's state dict], Note [load_state_dict into shards], Note [one-rank calls])."""

from __future__ import annotations

import pytest
import torch

from tests import module_surface_runs as runs
from tests.harness import run_distributed


def _run(fn, *args, world=2, timeout=240.0):
    return run_distributed(fn, world, *args, init_process_group=False, timeout=timeout)


@pytest.mark.parametrize(
    ("strategy", "precision", "world"),
    [
        ("zero3", "32-true", 2),
        pytest.param("zero3", "bf16-mixed", 2, marks=pytest.mark.slow),
        pytest.param("disk_tiers", "32-true", 2, marks=pytest.mark.slow),
        pytest.param("zeropp", "32-true", 4, marks=pytest.mark.slow),
    ],
)
def test_state_dict_and_lazy_load_through_hooks_match_ddp(tmp_path, strategy, precision, world):
    ddp = _run(runs.round_trip, "ddp", precision, str(tmp_path), world, world=world)
    zero = _run(runs.round_trip, strategy, precision, str(tmp_path), world, world=world)
    # qwZ/qgZ quantize what travels: the README's ZeRO++ accuracy, not DDP's bits
    tolerance = {"32-true": 1e-5, "bf16-mixed": 2e-2}[precision] if strategy != "zeropp" else 5e-2
    for d, z in zip(ddp, zero, strict=True):
        assert z["kinds"] == ["DTensor"]
        assert d["kinds"] == ["Tensor"]
        assert d["keys"] == z["keys"] == ([], [])
        assert z["post_hooks"] == d["post_hooks"] == 1
        full_numel = sum(v.numel() for v in z["full"].values())
        assert z["local"] <= full_numel / world + 64 * len(z["full"]), "each rank holds its rows (a row of padding)"
        assert all(torch.equal(z["whole"][k], v) for k, v in z["full"].items())  # full_state_dict(): the same
        torch.testing.assert_close(z["losses"], d["losses"], rtol=tolerance, atol=tolerance)
        for key, value in d["full"].items():
            torch.testing.assert_close(z["full"][key], value, rtol=tolerance, atol=tolerance, msg=key)
            # what was loaded is what the file holds: exactly what the state dict gave
            torch.testing.assert_close(z["reloaded"][key], z["full"][key], rtol=0, atol=0, msg=key)


@pytest.mark.slow
def test_state_dict_is_what_torch_distributed_checkpoint_reads():
    for rank in _run(runs.dcp_full_state_dict):
        assert rank["equal"], rank["keys"]  # get_model_state_dict(full_state_dict=True, cpu_offload=True)


def test_state_dict_inside_gathered_parameters_stays_valid_after_it_and_bad_loads_leave_the_model_whole(tmp_path):
    for rank in _run(runs.inside_gather, str(tmp_path)):
        assert rank["same"], "the file saved after the context holds the values taken inside it"
        assert rank["nbytes"] == rank["expected"], "each entry owns its memory (no view of a released buffer)"
        size, assign = rank["errors"]
        assert "size mismatch for gpt.wte.weight" in size, size  # torch's own message
        assert assign.startswith("ValueError"), assign
        assert "assign=False" in assign, assign
        assert rank["usable"]


def test_forward_and_state_dict_on_one_rank_are_served_by_a_rank_waiting_in_barrier():
    results = _run(runs.one_rank_forward, "barrier")
    assert results[0]["outcome"] == [True] * 5, results[0]["outcome"]
    assert all(len(r["after"]) == 2 for r in results), "training goes on together afterwards"


def test_one_rank_forward_fails_within_seconds_when_the_others_do_not_wait():
    results = _run(runs.one_rank_forward, "train")
    outcome = results[0]["outcome"]
    assert isinstance(outcome, str), outcome
    assert outcome.startswith("OneRankCallError"), outcome
    assert "HINT" in outcome, outcome
    assert "fabric.barrier()" in outcome, outcome
    assert results[0]["elapsed"] < 10, results[0]["elapsed"]  # the rendezvous waits min(collective timeout, 30 s)


@pytest.mark.slow
def test_second_trainer_validates_and_fits_a_stage3_model_as_ddp_with_one_rank_sampling():
    """Lightning's FSDP tests fit, then validate and fit again with a new Trainer; rank 0 samples alone after each
    validation while the others wait in ``trainer.strategy.barrier()``."""
    ddp = _run(runs.fit_validate_fit, "ddp")
    zero = _run(runs.fit_validate_fit, "zero3")
    for d, z in zip(ddp, zero, strict=True):
        assert len(z["losses"]) == len(d["losses"]) == 6
        assert len(z["val"]) == len(d["val"]) > 0
        torch.testing.assert_close(z["losses"], d["losses"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(z["val"], d["val"], rtol=1e-5, atol=1e-6)
        assert len(z["samples"]) == len(d["samples"])
        assert all(map(torch.equal, z["samples"], d["samples"]))
        for name, value in d["weights"].items():
            torch.testing.assert_close(z["weights"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert len(zero[0]["samples"]) == 3
    assert not zero[1]["samples"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_zero3_spawn_returns_ddp_weights_to_the_main_process():
    reference = runs.spawn_fit("ddp_spawn")
    sharded = runs.spawn_fit("zero3_spawn")
    initial = runs._Sampling()
    for name, value in reference.items():
        assert torch.isfinite(sharded[name]).all(), name
        torch.testing.assert_close(sharded[name], value, rtol=1e-5, atol=1e-6, msg=name)
        assert not torch.equal(sharded[name], dict(initial.named_parameters())[name]), f"{name} was not trained"


@pytest.mark.slow
def test_peft_saves_and_loads_its_adapters_through_the_stage3_model_as_under_ddp(tmp_path):
    ddp = _run(runs.peft_adapters, "ddp", str(tmp_path))
    zero = _run(runs.peft_adapters, "zero3", str(tmp_path))
    for d, z in zip(ddp, zero, strict=True):
        assert z["adapters"].keys() == d["adapters"].keys()
        assert len(d["adapters"]) == 8
        assert z["unexpected"] == d["unexpected"] == []
        torch.testing.assert_close(z["losses"], d["losses"], rtol=1e-5, atol=1e-6)
        assert d["pretrained"]
        assert z["pretrained"].keys() == d["pretrained"].keys()
        for key, value in d["pretrained"].items():  # peft's save_pretrained inside full_state_dict()
            torch.testing.assert_close(z["pretrained"][key], value, rtol=1e-5, atol=1e-6, msg=key)
        for key, value in d["adapters"].items():
            torch.testing.assert_close(z["adapters"][key], value, rtol=1e-5, atol=1e-6, msg=key)
            torch.testing.assert_close(z["reloaded"][key], z["adapters"][key], rtol=0, atol=0, msg=key)
        assert z["merged"].keys() == d["merged"].keys()
        assert not any("lora" in key for key in d["merged"]), list(d["merged"])
        for key, value in d["merged"].items():  # merge_and_unload in gathered_parameters(writeback=True)
            torch.testing.assert_close(z["merged"][key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.slow
def test_one_rank_forward_under_the_trainer_fails_within_seconds_when_the_others_train_on():
    results = _run(runs.one_rank_trainer_unserved)
    outcome = results[0]["outcome"]
    assert outcome.startswith("OneRankCallError"), outcome
    assert "trainer.strategy.barrier()" in outcome, outcome
    assert results[0]["elapsed"] < 30, results[0]["elapsed"]  # the fit included; the call waits 4 s
    assert results[1]["outcome"] != "finished"  # rank 1's next gather fails too, instead of waiting on
