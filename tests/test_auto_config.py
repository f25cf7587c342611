"""``strategy="zero_auto"`` / ``ZeroStrategy(stage="auto")``: the cheapest configuration whose predicted peak fits,
chosen the same on every rank, printed, logged and recorded in checkpoints; and the run fits the budget it was
chosen for (measured). The full matrix of forced choices, measured: ``--runslow``."""

from __future__ import annotations

import dataclasses

import lightning.pytorch as pl
import pytest
import torch

import lightning_zero  # noqa: F401  (registers the presets)
from lightning_zero import ZeroConfig, ZeroStrategy
from lightning_zero.__main__ import main as cli
from lightning_zero.planning.auto_config import Budget, Candidate, Decision, candidates, decide
from lightning_zero.planning.fake_step import PeakBytes
from lightning_zero.planning.model_state import ModelStateBytes
from lightning_zero.planning.peak import PeakPrediction
from tests.harness import run_distributed
from tests.peak_runs import auto_decision, auto_fit, auto_options


def test_stage_auto_sets_the_auto_field_and_its_settings_are_checked():
    assert ZeroConfig.from_kwargs(stage="auto", bucket_numel=10) == ZeroConfig(auto=True, stage=3, bucket_numel=10)
    assert ZeroStrategy(stage="auto").config.auto
    assert isinstance(pl.Trainer(strategy="zero_auto", accelerator="cpu", devices=1).strategy, ZeroStrategy)
    with pytest.raises(ValueError, match=r"ZeroConfig\.auto_device_budget: 0\. Expected a positive"):
        ZeroConfig(auto=True, auto_device_budget=0)
    with pytest.raises(ValueError, match=r"ZeroConfig\.auto_headroom: 1\.5\. Expected a fraction"):
        ZeroConfig(auto=True, auto_headroom=1.5)
    with pytest.raises(ValueError, match=r"HINT: to have it chosen when fit starts, set auto=True"):
        ZeroConfig(stage="auto")  # type: ignore[arg-type]


def test_candidates_go_from_least_to_most_sharding_and_use_zeropp_across_nodes():
    one_node = [name for name, _ in candidates(ZeroConfig(auto=True), ranks_per_node=8, world_size=8)]
    assert one_node == [
        "stage 1",
        "stage 2",
        "stage 3",
        "stage 3, optimizer in host memory",
        "stage 3, optimizer and parameters in host memory",
    ]  # no offload_dir: no disk tier
    configs = dict(candidates(ZeroConfig(auto=True, offload_dir="/scratch"), ranks_per_node=8, world_size=32))
    stage3 = configs["stage 3, hpZ and qwZ across nodes"]
    assert (stage3.stage, stage3.hpz_partition_size, stage3.quantize_weights) == (3, 8, True)
    assert not configs["stage 2"].uses_zeropp
    disk = configs["stage 3, optimizer and parameters on disk, hpZ and qwZ across nodes"]
    assert (disk.offload_optimizer, disk.offload_params) == ("disk", "disk")
    assert all(not c.auto for c in configs.values())
    # The user's own ZeRO++ settings are kept.
    own = ZeroConfig.from_kwargs(stage="auto", ranks_per_node=8, hpz_partition_size=4)
    assert dict(candidates(own, 8, 32))["stage 3"].hpz_partition_size == 4


def _prediction(config: ZeroConfig, device: int, host: int = 0) -> PeakPrediction:
    return PeakPrediction(
        config, 2, PeakBytes(device, 0, 0, 0, 0), "optimizer step", host, 0, ModelStateBytes(0, 0, 0, 0), 0
    )


def test_the_first_candidate_that_fits_is_chosen_and_host_memory_counts_on_a_cpu():
    options = candidates(ZeroConfig(auto=True), 2, 2)
    needs = {"stage 1": 300, "stage 2": 200, "stage 3": 150, "stage 3, optimizer in host memory": 100}
    hosts = {"stage 3, optimizer in host memory": 50}

    def predict(config: ZeroConfig) -> PeakPrediction:
        name = next(n for n, c in options if c == config)
        return _prediction(config, needs.get(name, 90), hosts.get(name, 60))

    gpu = decide(predict, options, Budget(device=180, host=1000, disk=0, host_is_device=False), headroom=0.0)
    assert gpu.candidates[gpu.chosen].name == "stage 3"
    assert [c.fits for c in gpu.candidates] == [False, False, True]  # nothing after the choice is predicted
    tight = decide(predict, options, Budget(device=140, host=1000, disk=0, host_is_device=False), headroom=0.0)
    assert tight.candidates[tight.chosen].name == "stage 3, optimizer in host memory"
    # On a CPU the host tier is the device's memory: 100 + 50 does not fit in 140, nor 90 + 60.
    cpu = decide(predict, options, Budget(device=140, host=1000, disk=0, host_is_device=True), headroom=0.0)
    assert cpu.chosen == -1
    assert "no configuration fits" in cpu.refusal()
    assert "HINT" in cpu.refusal()
    with pytest.raises(RuntimeError, match="no configuration fits"):
        _ = cpu.config
    # The headroom is kept free: 180 with 10% kept leaves 162 for stage 3's 150.
    assert decide(predict, options, Budget(180, 1000, 0, False), headroom=0.2).chosen != gpu.chosen


@pytest.mark.parametrize(
    "name", [pytest.param("gpt", marks=pytest.mark.slow), pytest.param("llama", marks=pytest.mark.slow), "lora"]
)
def test_each_budget_forces_the_least_sharded_candidate_that_fits_as_a_person_would_pick(name, tmp_path):
    forced = auto_options(name, str(tmp_path))
    order = [n for n, _ in candidates(ZeroConfig(auto=True, offload_dir="x"), 2, 2)]
    assert [n for n, _ in forced] == sorted((n for n, _ in forced), key=order.index)
    assert forced[0][0] == "stage 1"
    assert len(forced) >= 2
    for expected, budget in forced:
        decision = auto_decision(name, str(tmp_path), Budget(budget, 0, 2**40, host_is_device=True))
        assert decision.candidates[decision.chosen].name == expected
        # Everything before it was predicted and did not fit; a person would have taken the first that fits.
        assert [c.fits for c in decision.candidates] == [False] * decision.chosen + [True]


def _auto_runs(name: str, budgets: list[int], root: str) -> list[dict[str, object]]:
    return [auto_fit(name, budget, f"{root}/{i}") for i, budget in enumerate(budgets)]


def _check_auto(name: str, forced: list[tuple[str, int]], root: str) -> None:
    results = run_distributed(_auto_runs, 2, name, [b for _, b in forced], root, init_process_group=False, timeout=900)
    for rank, runs in enumerate(results):
        for (expected, budget), run in zip(forced, runs, strict=True):
            assert run["chosen"] == expected, (name, budget, run["chosen"])
            assert run["measured"] <= budget, (name, expected, run["measured"], budget)  # the run fits (measured)
            record = run["checkpoint"]
            assert isinstance(record, dict)
            assert record["candidate"] == expected
            assert record["device_budget_bytes"] == budget
            if rank == 0:
                assert f"zero_auto/candidate: {expected}" in str(run["hparams"])


@pytest.mark.timeout(300)
def test_zero_auto_chooses_stage_3_for_a_lora_model_that_does_not_fit_at_stage_1_and_the_run_fits(tmp_path):
    forced = auto_options("lora", str(tmp_path / "offload"))
    _check_auto("lora", [f for f in forced if f[0] == "stage 3"], str(tmp_path))


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name", ["gpt", "llama", "lora"])
def test_zero_auto_makes_each_forced_choice_and_every_run_fits_its_budget(name, tmp_path):
    _check_auto(name, auto_options(name, str(tmp_path / "offload")), str(tmp_path))


def test_estimate_auto_prints_the_decision_without_training(capsys):
    argv = ["estimate", "--model", "tests.peak_models.LlamaModule", "--model.batch_size=2", "--gpus", "2"]
    assert cli([*argv, "--precision", "fp32", "--auto", "--device-budget", "8e7"]) == 0
    out = capsys.readouterr().out
    assert "stage='auto': device budget 76.3 MiB" in out
    chosen = [line for line in out.splitlines() if line.rstrip().endswith("chosen")]
    assert len(chosen) == 1
    assert chosen[0].split()[:2] == ["stage", "2"]


def test_a_decision_records_plain_types_only():
    config = ZeroConfig(stage=2)
    decision = Decision(0, (Candidate("stage 2", _prediction(config, 10), 5, True, "fits"),), Budget(20, 0, 0, True))
    record = decision.record()
    assert record["stage"] == 2
    assert record["predicted_peak_bytes"] == 10
    assert all(isinstance(v, (int, str, bool)) for v in record.values())
    torch.save(record, "/dev/null")  # loads with weights_only: plain types
    assert dataclasses.replace(decision.config, auto=False) == config
