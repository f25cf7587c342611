"""The Lightning Fabric front door: ``Fabric(strategy="zero1/2/3")`` gives Fabric's DDP numbers in a Fabric loop."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY

from lightning_zero import ZeroConfig, ZeroFabricStrategy
from tests.fabric_runs import ddp_and_zero, several
from tests.harness import run_distributed
from tests.parity import assert_runs_match
from tests.test_precision import BF16_LOSS_RTOL, BF16_WEIGHT_ATOL, BF16_WEIGHT_RTOL


def test_zero_names_are_registered_with_fabric():
    for name, stage in [("zero1", 1), ("zero2", 2), ("zero3", 3), ("zero3_offload", 3)]:
        strategy = Fabric(strategy=name, accelerator="cpu", devices=2).strategy
        assert isinstance(strategy, ZeroFabricStrategy)
        assert strategy.config.stage == stage
    assert STRATEGY_REGISTRY["zero3_offload"]["init_params"]["offload_params"] == "cpu"
    config = ZeroConfig(stage=2, bucket_numel=1234)
    assert Fabric(strategy=ZeroFabricStrategy(config), accelerator="cpu", devices=2).strategy.config is config


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fabric_zero_matches_fabric_ddp_with_accumulation_and_clipping(stage):
    for reference, sharded in run_distributed(ddp_and_zero, 2, stage, "gpt", 3, 2, 0.5, init_process_group=False):
        assert_runs_match(reference, sharded)
        torch.testing.assert_close(torch.tensor(sharded.extra["norms"]), torch.tensor(reference.extra["norms"]))
        assert min(reference.extra["norms"]) > 0.5  # the clipping clipped


@pytest.mark.timeout(180)
def test_fabric_zero3_matches_fabric_ddp_on_a_hugging_face_model_and_its_lora():
    cases = [(3, "hf_causal_lm", 2, 2, 1.0), (3, "hf_lora", 2, 2, 0.05)]
    for runs in run_distributed(several, 2, cases, init_process_group=False, timeout=170):
        for reference, sharded in runs:
            assert_runs_match(reference, sharded)
            torch.testing.assert_close(torch.tensor(sharded.extra["norms"]), torch.tensor(reference.extra["norms"]))
        lora = runs[1][1].weights
        assert any("lora_" in n for n in lora)
        assert len(lora) > 2 * sum("lora_" in n for n in lora)  # the frozen base is compared too


@pytest.mark.timeout(120)
def test_fabric_bf16_mixed_matches_fabric_ddp_within_bf16_rounding():
    cases = [(stage, "mlp", 4, 2, 0.05, "bf16-mixed") for stage in (1, 3)]
    for runs in run_distributed(several, 2, cases, init_process_group=False):
        for reference, sharded in runs:
            torch.testing.assert_close(
                torch.tensor(sharded.losses), torch.tensor(reference.losses), rtol=BF16_LOSS_RTOL["bf16-mixed"], atol=0
            )
            for fqn, expected in reference.weights.items():
                torch.testing.assert_close(
                    sharded.weights[fqn],
                    expected.bfloat16().float(),
                    rtol=BF16_WEIGHT_RTOL,
                    atol=BF16_WEIGHT_ATOL,
                    msg=fqn,
                )
