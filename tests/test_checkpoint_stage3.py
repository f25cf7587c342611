"""Sharded checkpoints of stage 3: exact resume, and loading across stages and world sizes in both directions."""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist

from lightning_zero import ZeroConfig, ZeroOptimizer, load_full_state_dict, shard_module
from lightning_zero.models.gpt import GPT, GPTConfig
from tests.harness import run_distributed
from tests.test_checkpoint_trainer import (
    _load,
    _resume_exactly,
    _save_at_step_4,
    assert_same,
    assert_same_training_state,
)


@pytest.mark.timeout(150)
def test_stage3_resume_is_bit_identical_to_uninterrupted():
    with tempfile.TemporaryDirectory() as root:
        for uninterrupted, *resumed in run_distributed(
            _resume_exactly, 2, root, 3, 2, True, "32-true", init_process_group=False
        ):
            assert len(resumed) == 2  # mid-epoch and end of epoch
            for weights_after_resume in resumed:
                assert_same(weights_after_resume, uninterrupted)


@pytest.mark.timeout(180)
def test_stage3_checkpoints_load_at_other_stages_and_world_sizes():
    with tempfile.TemporaryDirectory() as root:
        saved = run_distributed(_save_at_step_4, 2, root, 3, init_process_group=False)
        source = f"{root}/w2/epoch=0-step=4.ckpt"
        # stage 3 at 2 ranks -> stage 1 at 4 ranks (saved again) -> stage 3 at 2 ranks; stage 3 -> stage 2 at 1 rank.
        at4 = run_distributed(_load, 4, root, source, 1, 4, f"{root}/w4.ckpt", init_process_group=False)
        back = run_distributed(_load, 2, root, f"{root}/w4.ckpt", 3, 2, None, init_process_group=False)
        at1 = run_distributed(_load, 1, root, source, 2, 1, None, init_process_group=False)
    for loaded in (at4, back, at1):
        assert_same_training_state(loaded, saved)


def _pretrained_into_stage3(path: str) -> tuple[list[bool], bool]:
    torch.manual_seed(dist.get_rank())  # every rank starts elsewhere; the load must overwrite all of it
    config = ZeroConfig(stage=3)
    with torch.device("meta"):  # never built whole: materialized and sharded unit by unit
        model = GPT(GPTConfig.tiny(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16, bias=False))
    gatherer = shard_module(model, config, dist.group.WORLD, torch.device("cpu"))
    optimizer = ZeroOptimizer(model, torch.optim.AdamW(model.parameters()), dist.group.WORLD, config, gatherer)
    load_full_state_dict(model, path, optimizers=[optimizer])
    expected = torch.load(path, weights_only=True)
    with gatherer.gathered():
        same = [torch.equal(v, expected[k]) for k, v in model.state_dict().items()]
    model(torch.zeros(2, 8, dtype=torch.long)).sum().backward()
    optimizer.step()
    return same, all(u.state.value == "sharded" for u in gatherer.units)


@pytest.mark.timeout(60)
def test_pretrained_state_dict_loads_into_a_stage3_model_built_on_meta(tmp_path):
    torch.manual_seed(0)
    source = GPT(GPTConfig.tiny(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16, bias=False))
    torch.save(source.state_dict(), tmp_path / "pretrained.pt")
    for same, sharded in run_distributed(_pretrained_into_stage3, 2, str(tmp_path / "pretrained.pt")):
        assert same
        assert all(same)
        assert sharded


@pytest.mark.timeout(150)
@pytest.mark.parametrize("devices", [pytest.param(1, marks=pytest.mark.slow), 4])  # 1 rank: 6 s, behind --runslow
def test_stage3_resume_is_bit_identical_at_one_and_four_ranks(devices):
    with tempfile.TemporaryDirectory() as root:
        for uninterrupted, resumed in run_distributed(
            _resume_exactly, devices, root, 3, devices, False, "32-true", init_process_group=False
        ):
            assert_same(resumed, uninterrupted)
