"""Stage 3's step gathers the next forward's first units while it steps the rest (Note [gathered ahead of the
forward]): what is gathered between steps, and that a shard written after the step is never read stale."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_zero import ZeroConfig, ZeroOptimizer, shard_module
from lightning_zero.models.gpt import GPT, GPTConfig
from tests.harness import run_distributed

CPU = torch.device("cpu")


def _steps_with_an_edit_between(ahead: bool) -> dict[str, Any]:
    """Two steps, then every rank writes the root's shards in place (as a checkpoint load or an EMA swap would),
    then two more steps. ``ahead=False`` disables gathering ahead (and prefetching): the reference."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(GPTConfig.tiny(n_layer=3, n_embd=32, vocab_size=64))
    config = ZeroConfig(stage=3, prefetch_limit_numel=None if ahead else 0)
    gatherer = shard_module(model, config, dist.group.WORLD, CPU)
    optimizer = ZeroOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), dist.group.WORLD, config, gatherer)
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(dist.get_rank()))
    losses, states = [], []
    for step in range(4):
        if step == 2:
            with torch.no_grad():
                for bucket in gatherer.units[0].buckets:
                    bucket.param_shard.add_(0.25)
        optimizer.zero_grad()
        loss = model.loss(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        states.append([u.state.value for u in gatherer.units])
    gathers = optimizer.ledger.last_step["all_gather"]
    with gatherer.gathered():
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "states": states, "weights": weights, "gathers": gathers,
            "lead": [u.name for u in gatherer.lead_units()]}  # fmt: skip


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [2, 4])
def test_the_step_gathers_the_first_units_ahead_and_a_later_shard_edit_is_seen(world_size):
    ahead = run_distributed(_steps_with_an_edit_between, world_size, True)
    reference = run_distributed(_steps_with_an_edit_between, world_size, False)
    for run, ref in zip(ahead, reference, strict=True):
        assert run["lead"] == ["<root>", "blocks.0"]
        assert ref["lead"] == []
        # From the first step on (whose end knows the forward order), the step leaves exactly those gathering.
        for states in run["states"]:
            assert states == ["gathering", "gathering", "sharded", "sharded"], run["states"]
        assert all(set(states) == {"sharded"} for states in ref["states"])
        # The edit after step 2 was seen by the forward of step 3: the root was gathered again, not read stale.
        assert run["losses"] == ref["losses"]
        for name, value in run["weights"].items():
            assert torch.equal(value, ref["weights"][name]), name
        assert run["gathers"] == ref["gathers"]  # the same bytes per step: gathered earlier, not more often


def _ahead_then_a_load() -> list[float]:
    """A step, then a load of the model's weights saved before it (every shard written), then a forward: its loss
    is the loss of the saved weights."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(GPTConfig.tiny(n_layer=2, n_embd=32, vocab_size=64))
    config = ZeroConfig(stage=3)
    gatherer = shard_module(model, config, dist.group.WORLD, CPU)
    optimizer = ZeroOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.5), dist.group.WORLD, config, gatherer)
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(2):
        optimizer.zero_grad()
        model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.step()
    with torch.no_grad():
        before = model.loss(tokens[:, :-1], tokens[:, 1:]).item()
    with gatherer.gathered():
        saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer.zero_grad()
    model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    optimizer.step()  # gathers root and blocks.0 ahead, from the new shards
    with gatherer.gathered(writeback=True), torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(saved[name])
    with torch.no_grad():
        after = model.loss(tokens[:, :-1], tokens[:, 1:]).item()
    return [before, after]


@pytest.mark.timeout(60)
def test_weights_written_back_after_the_step_reach_the_units_gathered_ahead():
    for before, after in run_distributed(_ahead_then_a_load, 2):
        assert after == before
