"""The Lightning Fabric front door: ``Fabric(strategy="zero1/2/3")`` gives Fabric's DDP numbers in a Fabric loop."""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY
from torch import nn

from lightning_zero import ZeroConfig, ZeroFabricStrategy, ZeroStrategy
from lightning_zero.hydra.schema import register_configs
from lightning_zero.models.gpt import GPT, GPTConfig
from lightning_zero.stage3.library_init import library_inits
from tests import memory_probe
from tests.fabric_runs import (
    batch_norm_runs,
    built_on_meta_and_two_optimizers,
    ddp_only,
    fp16_runs,
    make_fabric,
    several,
    zero_only,
)
from tests.harness import run_distributed
from tests.parity import Run, assert_runs_match
from tests.test_example import ROOT
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
@pytest.mark.parametrize("stage", [1, 2, 3, {"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"}], ids=str)
def test_fabric_zero_matches_fabric_ddp_with_accumulation_and_clipping(stage):
    sharded_runs = run_distributed(zero_only, 2, stage, "gpt", 3, 2, 0.5, init_process_group=False)
    for reference, sharded in zip(_fabric_ddp_reference(), sharded_runs, strict=True):
        assert_runs_match(reference, sharded)
        torch.testing.assert_close(torch.tensor(sharded.extra["norms"]), torch.tensor(reference.extra["norms"]))
        assert min(reference.extra["norms"]) > 0.5  # the clipping clipped


@functools.cache
def _fabric_ddp_reference() -> list[Run]:
    """Each rank's Fabric DDP run for the test above: no ZeRO option changes it, so its four cases share it."""
    return run_distributed(ddp_only, 2, "gpt", 3, 2, 0.5, init_process_group=False)


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
def test_fabric_bf16_matches_fabric_ddp_within_bf16_rounding():
    precisions = ["bf16-mixed", "bf16-mixed", "bf16-true"]
    cases = [(stage, "mlp", 4, 2, 0.05, precision) for stage, precision in zip((1, 3, 3), precisions, strict=True)]
    for runs in run_distributed(several, 2, cases, init_process_group=False):
        for (reference, sharded), precision in zip(runs, precisions, strict=True):
            torch.testing.assert_close(
                torch.tensor(sharded.losses), torch.tensor(reference.losses), rtol=BF16_LOSS_RTOL[precision], atol=0
            )
            for fqn, expected in reference.weights.items():
                torch.testing.assert_close(
                    sharded.weights[fqn],
                    expected.bfloat16().float(),
                    rtol=BF16_WEIGHT_RTOL,
                    atol=BF16_WEIGHT_ATOL,
                    msg=fqn,
                )


# -- fabric.init_module(empty_init=True) under stage 3 ---------------------------------------------------------------
def _empty_init_then_setup() -> dict[str, Any]:
    memory_probe.return_freed_memory_to_the_kernel()
    config = GPTConfig.tiny(n_layer=12, n_embd=512, n_head=4, vocab_size=64, block_size=32, bias=False)
    fabric = make_fabric(ZeroFabricStrategy(stage=3, collective_timeout_s=77))
    with torch.device("meta"):  # what does not grow with the model: the initializer check reads the classes' source
        library_inits(GPT(GPTConfig.tiny()))
    memory_probe.reset_peak()
    before = memory_probe.rss_bytes()
    torch.manual_seed(1234)
    with fabric.init_module(empty_init=True):
        model = GPT(config)
    on_meta = all(p.is_meta for p in model.parameters())
    model = fabric.setup_module(model)
    peak = memory_probe.peak_rss_bytes() - before
    torch.manual_seed(1234)
    direct = GPT(config)  # after the measurement: this one is whole
    with fabric.strategy.gathered_parameters():  # type: ignore[attr-defined]
        mismatched = [
            n for (n, p), q in zip(direct.named_parameters(), model.module.parameters(), strict=True) if not p.equal(q)
        ]
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(fabric.global_rank))
    loss = nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    fabric.backward(loss)
    optimizer.step()
    return {
        "on_meta": on_meta,
        "peak": peak,
        "full": sum(p.numel() * p.element_size() for p in direct.parameters()),
        "unit": sum(p.numel() * p.element_size() for p in direct.blocks[0].parameters()),
        "mismatched": mismatched,
        "loss": loss.item(),
        "collectives": (
            fabric.all_gather(torch.tensor(fabric.global_rank)).tolist(),
            float(fabric.all_reduce(torch.tensor(fabric.global_rank + 1.0), reduce_op="sum")),
            fabric.broadcast(f"from {fabric.global_rank}", src=1),
        ),
        "timeout": fabric.strategy._timeout.total_seconds(),  # type: ignore[attr-defined]
    }


@pytest.mark.timeout(120)
def test_empty_init_builds_on_meta_and_setup_materializes_shard_by_shard_as_a_direct_build():
    for result in run_distributed(_empty_init_then_setup, 2, init_process_group=False):
        assert result["on_meta"]
        assert result["mismatched"] == []  # the weights of a direct build from the same seed
        # 151 MB of fp32 weights in 12 units of 12.6 MB: a rank's peak while materializing is its shard (half) and a
        # few units (one being initialized, its flat copy, the last broadcast gloo still holds), never the model.
        peak, full, unit = result["peak"], result["full"], result["unit"]
        assert peak < full / 2 + 3 * unit, (peak, full, unit)
        assert peak < 0.75 * full, (peak, full)
        assert math.isfinite(result["loss"])
        assert result["collectives"] == ([0, 1], 3.0, "from 1")  # Fabric's collectives, as under its DDP
        assert result["timeout"] == 77  # ZeroConfig.collective_timeout_s: the timeout the process group is made with


@pytest.mark.parametrize("name", ["zero3pp", "zero2_offload"])
def test_a_hydra_strategy_config_instantiates_either_front_door(name):
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        trainer = compose(config_name="config", overrides=[f"strategy={name}"]).strategy
        fabric = compose(
            config_name="config", overrides=[f"strategy={name}", "strategy._target_=lightning_zero.ZeroFabricStrategy"]
        ).strategy
    for_trainer, for_fabric = instantiate(trainer, _convert_="all"), instantiate(fabric, _convert_="all")
    assert isinstance(for_trainer, ZeroStrategy)
    assert isinstance(for_fabric, ZeroFabricStrategy)
    assert for_fabric.config == for_trainer.config
    assert for_fabric._start_method == for_trainer._start_method


def _meta_and_two_optimizers() -> list[list[Any]]:
    return [built_on_meta_and_two_optimizers(stage) for stage in (2, 3)]


@pytest.mark.timeout(120)
def test_a_model_built_on_meta_set_up_with_two_optimizers_at_once_matches_fabric_ddp():
    for runs in run_distributed(_meta_and_two_optimizers, 2, init_process_group=False):
        for reference, sharded in runs:
            assert_runs_match(reference, sharded)
            torch.testing.assert_close(torch.tensor(sharded.extra["norms"]), torch.tensor(reference.extra["norms"]))


@pytest.mark.timeout(120)
def test_batch_norm_buffers_follow_rank_0_where_fabric_ddp_broadcasts_them():
    for (ddp_values, ddp_buffers), *zero in run_distributed(batch_norm_runs, 2, init_process_group=False):
        for values, buffers in zero:
            torch.testing.assert_close(torch.tensor(values), torch.tensor(ddp_values), rtol=1e-5, atol=1e-6)
            for buffer, expected in zip(buffers, ddp_buffers, strict=True):
                assert torch.equal(buffer, expected)


@pytest.mark.timeout(120)
def test_fp16_mixed_skips_the_steps_fabric_ddp_skips_and_matches_its_losses():
    for (ddp_losses, ddp_scale), *zero in run_distributed(fp16_runs, 2, init_process_group=False):
        assert ddp_scale < 2.0**24  # the first steps overflowed and were skipped
        for losses, scale in zero:
            assert scale == ddp_scale  # the same steps skipped, decided for every rank at once
            # fp16 keeps 11 significant bits; ZeRO's parameters are fp16 where DDP's are fp32 under autocast.
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ddp_losses), rtol=2**-9, atol=0)


def test_init_module_builds_on_meta_only_at_stage_3_with_empty_init():
    for name, empty_init, on_meta in [("zero3", True, True), ("zero3", None, False), ("zero2", True, False)]:
        strategy = Fabric(strategy=name, accelerator="cpu", devices=2).strategy
        with strategy.module_init_context(empty_init):  # what fabric.init_module enters
            assert nn.Linear(2, 2).weight.is_meta == on_meta, (name, empty_init)
