"""Per-rank model-state bytes follow the ZeRO paper's formulas; bytes per step are the bandwidth-optimal 2Ψ(N−1)/N."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_zero import ZeroConfig, ZeroOptimizer, expected_model_state_bytes, model_state_bytes
from lightning_zero.models.gpt import GPT, GPTConfig
from tests.harness import run_distributed


def _measure(stage: int, dtype_name: str) -> tuple[int, object, object, dict[str, int]]:
    torch.manual_seed(0)
    dtype = getattr(torch, dtype_name)
    model = GPT(GPTConfig.tiny(n_layer=2, n_embd=64, vocab_size=128)).to(dtype)
    num_params = sum(p.numel() for p in model.parameters())
    optimizer = ZeroOptimizer(
        model, torch.optim.AdamW(model.parameters()), dist.group.WORLD, ZeroConfig(stage=stage, bucket_numel=20_000)
    )
    tokens = torch.randint(0, 128, (2, 17))
    loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()  # allocates Adam's moments
    padding = sum(b.padded_numel - b.numel for b in optimizer.buckets)
    return num_params, model_state_bytes(model, [optimizer]), padding, optimizer.ledger.last_step_bytes()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_model_state_matches_paper_formula(world_size, stage):
    """bf16 parameters and gradients, fp32 master weights and Adam moments: 4Ψ + 12Ψ/N and 2Ψ + 14Ψ/N."""
    for num_params, measured, padding, _ in run_distributed(_measure, world_size, stage, "bfloat16"):
        expected = expected_model_state_bytes(num_params, world_size, stage)
        assert (
            expected.total
            == {1: 4 * num_params + 12 * num_params // world_size, 2: 2 * num_params + 14 * num_params // world_size}[
                stage
            ]
        )
        # Padding adds fewer than N elements per bucket to each flat tensor.
        slack = 16 * padding
        for field in measured._fields:
            got, want = getattr(measured, field), getattr(expected, field)
            assert want <= got <= want + slack, f"{field}: measured {got} B, formula {want} B (slack {slack} B)"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", [1, 2])
def test_fp32_parameters_are_their_own_master_weights(world_size, stage):
    for num_params, measured, padding, _ in run_distributed(_measure, world_size, stage, "float32"):
        expected = expected_model_state_bytes(num_params, world_size, stage, param_bytes=4, master_bytes=0)
        assert measured.master_weights == 0
        slack = 16 * padding
        assert expected.total <= measured.total <= expected.total + slack, (measured, expected)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", [1, 2])
def test_bytes_per_step_are_reduce_scatter_plus_all_gather(world_size, stage):
    for num_params, _, padding, sent in run_distributed(_measure, world_size, stage, "float32"):
        padded = num_params + padding
        one_way = 4 * padded * (world_size - 1) // world_size
        # Plus one tiny all-reduce: which parameters got a gradient (Note [unused parameters]).
        assert 0 < sent.pop("all_reduce") < one_way // 100
        assert sent == {"reduce_scatter": one_way, "all_gather": one_way}
        # = 2Ψ(N−1)/N elements in total, what DDP's all-reduce moves.
        assert sum(sent.values()) == 2 * one_way


def test_expected_formula_reproduces_the_paper_example():
    # ZeRO paper, Figure 1: Ψ = 7.5B, N = 64, K = 12.
    gb = [expected_model_state_bytes(7_500_000_000, 64, stage).total / 1e9 for stage in (0, 1, 2, 3)]
    assert [round(x, 1) for x in gb] == [120.0, 31.4, 16.6, 1.9]


def test_expected_formula_rejects_unknown_stage():
    with pytest.raises(ValueError, match="Invalid stage: 5"):
        expected_model_state_bytes(10, 2, 5)
