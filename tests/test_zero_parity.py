"""ZeRO stages 1 and 2 are DDP's mathematics: same losses at every step and same final weights (fp32, rtol 1e-5)."""

from __future__ import annotations

import pytest
import torch

from lightning_zero import ZeroConfig
from tests.harness import run_distributed
from tests.parity import (
    Run,
    assert_zero_matches_ddp,
    native_collectives_on,
    train,
    zero,
)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize(("model", "optimizer"), [("gpt", "adamw"), ("mlp", "sgd"), ("gpt", "sgd"), ("mlp", "adamw")])
def test_zero_matches_ddp(world_size, stage, model, optimizer):
    # Small buckets so the GPT spans several buckets and the ordered, overlapped launch is exercised.
    config = ZeroConfig(stage=stage, bucket_numel=4_000)
    assert_zero_matches_ddp(world_size, model, optimizer, 10, 1, config)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("overlap_comm", [True, False])
def test_zero_matches_ddp_with_grad_accumulation(stage, overlap_comm):
    config = ZeroConfig(stage=stage, bucket_numel=4_000, overlap_comm=overlap_comm)
    assert_zero_matches_ddp(2, "gpt", "adamw", 10, 3, config)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_matches_ddp_with_one_inflight_bucket_and_one_bucket_per_parameter(stage):
    config = ZeroConfig(stage=stage, bucket_numel=1, max_inflight_buckets=1)
    assert_zero_matches_ddp(2, "gpt", "adamw", 10, 1, config)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 2])
def test_world_size_one_is_a_degenerate_shard(stage):
    assert_zero_matches_ddp(1, "gpt", "adamw", 10, 2, ZeroConfig(stage=stage))


def _staged_and_sent_from_grad(model: str, accumulate: int, grad_accumulation: str) -> tuple[Run, Run]:
    config = ZeroConfig(stage=2, bucket_numel=2_000, grad_accumulation=grad_accumulation)  # type: ignore[arg-type]
    sent = train(model, "adamw", 4, accumulate, zero(config))
    with native_collectives_on():  # NCCL's branch: every bucket staged in a flat buffer
        staged = train(model, "adamw", 4, accumulate, zero(config))
    return sent, staged


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("model", "accumulate", "grad_accumulation"),
    [("gpt", 1, "sharded"), ("moe", 1, "sharded"), ("reentrant", 1, "sharded"), ("lora", 2, "local"),
     ("gpt", 2, "sharded")],
)  # fmt: skip
def test_gradients_sent_from_autograds_tensors_equal_the_staged_reduction_bit_for_bit(
    model, accumulate, grad_accumulation
):
    # Note [gradients sent from where autograd put them]: on two ranks both sum the same two numbers per element.
    # moe: experts some ranks never run (zeros sent); reentrant: a second gradient arrives in one round; lora:
    # frozen buckets and local accumulation across micro-batches.
    for sent, staged in run_distributed(_staged_and_sent_from_grad, 2, model, accumulate, grad_accumulation):
        assert sent.losses == staged.losses
        for name, value in staged.weights.items():
            assert torch.equal(sent.weights[name], value), name
