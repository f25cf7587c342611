"""Stage 3 on module boundaries: a unit is freed when its module's backward is over, input gradients included, so
frozen layers, adapters on a frozen base, frozen-only units and blocks returning any structure train as under DDP."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_zero import ZeroConfig, ZeroOptimizer, shard_module
from lightning_zero.comm.pending_collective import Collective
from lightning_zero.stage3.sharded_unit import UnitState
from tests.boundary_models import BUILDERS
from tests.harness import run_distributed
from tests.parity import (
    Run,
    assert_runs_match,
    batch,
    build_model,
    ddp_and_zero,
    ddp_reference,
    loss_fn,
    train,
    zero,
    zero3,
    zero_only,
)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("model", sorted(set(BUILDERS) - {"moe"}))
def test_boundary_models_match_ddp(model, stage):
    sharded_runs = run_distributed(zero_only, 2, model, "adamw", 5, 1, ZeroConfig(stage=stage))
    for reference, sharded in zip(ddp_reference(2, model, "adamw", 5, 1), sharded_runs, strict=True):
        assert all(torch.isfinite(torch.tensor(sharded.losses))), sharded.losses
        assert_runs_match(reference, sharded)


@pytest.mark.timeout(120)
def test_stage3_frozen_base_matches_ddp_with_local_accumulation():
    config = ZeroConfig(stage=3, grad_accumulation="local")
    for reference, sharded in run_distributed(ddp_and_zero, 2, "lora", "adamw", 3, 3, config):
        assert_runs_match(reference, sharded)


def _max_units_gathered_in_backward(accumulation: str) -> tuple[int, int, int]:
    """(max units other than the root gathered at once during backward, prefetch depth, units) over a step."""
    model = build_model("lora")
    config = ZeroConfig(stage=3, grad_accumulation=accumulation)  # type: ignore[arg-type]
    gatherer = shard_module(model, config, dist.group.WORLD, torch.device("cpu"))
    optimizer = ZeroOptimizer(model, torch.optim.AdamW(model.parameters()), dist.group.WORLD, config, gatherer)
    seen: list[int] = []

    def count(grad: torch.Tensor) -> None:
        seen.append(sum(u.state is not UnitState.SHARDED for u in gatherer.units[1:]))

    for step in range(2):
        for micro in range(2):
            context = optimizer.no_sync() if micro == 0 else torch.enable_grad()
            with context:
                x, y = batch("lora", dist.get_rank(), step, micro)
                hidden = model.embed(x)
                hidden.requires_grad_(True)  # count at the input end too
                for block in model.blocks:
                    hidden = block(hidden)
                    hidden.register_hook(count)
                loss = torch.nn.functional.cross_entropy(model.head(hidden).flatten(0, 1), y.flatten())
                loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return max(seen), 1, len(gatherer.units) - 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("accumulation", ["sharded", "local"])
def test_frozen_base_keeps_only_the_unit_in_use_and_the_prefetched_one_gathered(accumulation):
    for most, prefetched, units in run_distributed(_max_units_gathered_in_backward, 2, accumulation):
        assert units >= 3
        assert most <= 1 + prefetched, f"{most} of {units} units gathered at once in backward"


def _units_gathered_in_backward(name: str) -> list[str]:
    model = build_model(name)
    config = ZeroConfig(stage=3)
    gatherer = shard_module(model, config, dist.group.WORLD, torch.device("cpu"))
    optimizer = ZeroOptimizer(model, torch.optim.AdamW(model.parameters()), dist.group.WORLD, config, gatherer)
    gathers: list[str] = []
    for unit in gatherer.units:
        original = unit.gather

        def gather(*args: object, _unit=unit, _original=original) -> None:
            if _unit.state is UnitState.SHARDED and torch._C._current_graph_task_id() != -1:
                gathers.append(_unit.name)
            _original(*args)

        unit.gather = gather  # type: ignore[method-assign]
    x, y = batch(name, dist.get_rank(), 0, 0)
    loss_fn(name, model, (x, y)).backward()
    optimizer.step()
    return gathers


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("model", "expected"),
    [
        # Prompt tuning: only the input embedding trains, so backward crosses every frozen block (and the frozen
        # head, in the root unit) to reach it: each is gathered once in backward, for its input gradient.
        ("prompt_tuning", ["<root>", "blocks.0", "blocks.1", "blocks.2"]),
        # Only the head trains: autograd never reaches the frozen blocks, which are not gathered in backward.
        ("head_only", ["<root>"]),
    ],
)
def test_frozen_units_are_gathered_in_backward_only_when_autograd_reaches_them(model, expected):
    for gathers in run_distributed(_units_gathered_in_backward, 2, model):
        assert sorted(gathers) == expected, gathers


def _ddp_find_unused(model, optimizer):
    return DistributedDataParallel(model, find_unused_parameters=True), optimizer


def _moe_runs(stage: int) -> list[Run]:
    # AdamW: an expert no rank used in a step must keep its weights and optimizer state, as under DDP, where its
    # gradient is None (on odd steps two of the four experts of each block are unused everywhere).
    reference = train("moe", "adamw", 6, 1, _ddp_find_unused)
    if stage < 3:
        return [reference, train("moe", "adamw", 6, 1, zero(ZeroConfig(stage=stage)))]
    # The blocks are leaves (Note [leaf modules]); without leaves, the experts are merged in the first step.
    leaves = train("moe", "adamw", 6, 1, zero3(ZeroConfig(stage=3)))
    return [reference, leaves, train("moe", "adamw", 6, 1, zero3(ZeroConfig(stage=3, leaf_module_classes=())))]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_mixture_of_experts_with_rank_dependent_routing_matches_ddp_find_unused(stage):
    for reference, *sharded in run_distributed(_moe_runs, 2, stage, collective_timeout=30):
        for run in sharded:
            assert_runs_match(reference, run)


def _moe_units_after_first_step(config: ZeroConfig) -> tuple[dict[str, str], list[int]]:
    model = build_model("moe")
    gatherer = shard_module(model, config, dist.group.WORLD, torch.device("cpu"))
    optimizer = ZeroOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05), dist.group.WORLD, config, gatherer)
    calls: list[int] = []
    for step in range(3):
        loss_fn("moe", model, batch("moe", dist.get_rank(), step, 0)).backward()
        optimizer.step()
        calls.append(gatherer.ledger.calls.get(Collective.ALL_GATHER, 0))
    merged = {gatherer.units[c].name: gatherer.units[p].name for c, p in gatherer.exchange.merged_into.items()}
    per_step = [b - a for a, b in itertools.pairwise(calls)]
    return merged, per_step


@pytest.mark.timeout(60)
@pytest.mark.parametrize("leaves", ["automatic", "none"])
def test_experts_used_differently_across_ranks_are_merged_into_their_block(leaves):
    """With the automatic leaves each block is gathered whole from the start and nothing is merged; without any
    (``leaf_module_classes=()``) each expert is a unit, and those the ranks used differently in the first step are
    merged into their block with their siblings (Note [data-dependent units])."""
    config = ZeroConfig(stage=3, leaf_module_classes=None if leaves == "automatic" else ())
    results = run_distributed(_moe_units_after_first_step, 2, config, collective_timeout=30)
    for merged, per_step in results:
        experts = {f"blocks.{b}.experts.{e}": f"blocks.{b}" for b in range(2) for e in range(4)}
        assert merged == ({} if leaves == "automatic" else experts)
        assert per_step[0] == per_step[1], per_step  # steady state: the same gathers every step, whatever the data
    assert results[0] == results[1]


def _bytes_per_step(model_name: str, stage: int) -> dict[str, int]:
    model = build_model(model_name)
    config = ZeroConfig(stage=stage)
    gatherer = shard_module(model, config, dist.group.WORLD, torch.device("cpu")) if stage == 3 else None
    optimizer = ZeroOptimizer(model, torch.optim.AdamW(model.parameters()), dist.group.WORLD, config, gatherer)
    for step in range(2):
        loss_fn(model_name, model, batch(model_name, dist.get_rank(), step, 0)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer.ledger.last_step_bytes()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_reentrant_checkpointing_reduces_each_bucket_once(stage):
    reentrant = run_distributed(_bytes_per_step, 2, "reentrant", stage)
    plain = run_distributed(_bytes_per_step, 2, "non_reentrant", stage)
    assert reentrant == plain
    assert all(sent["reduce_scatter"] > 0 for sent in reentrant)


class _CalledInReverse(torch.nn.Module):
    """Layers called in the reverse of their registration order: backward completes the first-registered first."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in reversed(self.layers):
            x = layer(x).tanh()
        return x


def _launch_events(stage: int) -> list[list[str]]:
    """Per step, the order of gradient arrivals ("grad") and bucket launches ("launch") during backward."""
    torch.manual_seed(0)
    model = _CalledInReverse()
    events: list[str] = []
    for p in model.parameters():  # registered first: runs before the reducer's hook on the same gradient
        p.register_post_accumulate_grad_hook(lambda _: events.append("grad"))
    config = ZeroConfig(stage=stage, bucket_numel=16 * 16 + 16)  # one layer per bucket
    optimizer = ZeroOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), dist.group.WORLD, config)
    launch = optimizer.reducer._launch

    def recording_launch(bucket):
        events.append("launch")
        return launch(bucket)

    optimizer.reducer._launch = recording_launch
    steps = []
    for step in range(3):
        events.clear()
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(dist.get_rank() * 10 + step))
        model(x).square().mean().backward()
        steps.append(list(events))
        optimizer.step()
        optimizer.zero_grad()
    return steps


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", [1, 2])
def test_buckets_follow_the_observed_backward_order_after_the_first_step(stage):
    for steps in run_distributed(_launch_events, 2, stage):
        first, later = steps[0], steps[2]
        assert first.count("launch") == later.count("launch") == 4
        # Step 1: launches wait for the first-numbered bucket, whose gradients come last.
        assert first.index("launch") > len(first) - first[::-1].index("grad") - 1, first
        # Later: each bucket goes out as soon as it is complete, before the backward is over.
        assert later.index("launch") < len(later) - later[::-1].index("grad") - 1, later


def _root_modules_outside_a_step() -> tuple[bool, float, bool]:
    """Call the root unit's modules (embedding, head) directly after training, as sampling in a hook does."""
    model = build_model("frozen_norm")
    reference = build_model("frozen_norm")
    config = ZeroConfig(stage=3)
    gatherer = shard_module(model, config, dist.group.WORLD, torch.device("cpu"))
    tokens = torch.arange(8)[None]
    with torch.no_grad():
        hidden = model.embed(tokens)
        for block in model.blocks:
            hidden = block(hidden)
        logits = model.head(hidden)
        expected = reference(tokens)
    root_sharded = gatherer.units[0].state is UnitState.SHARDED
    return bool(torch.isfinite(logits).all()), (logits - expected).abs().max().item(), root_sharded


@pytest.mark.timeout(60)
def test_root_unit_modules_called_outside_a_step_gather_the_root():
    for finite, error, root_sharded in run_distributed(_root_modules_outside_a_step, 2):
        assert finite
        assert error < 1e-6
        assert root_sharded  # and freed again afterwards


def _compiled_runs(stage: int) -> list[list[float]]:
    """DDP + compile and ZeRO + compile of the same model, 3 steps each: the per-step losses."""
    runs = []
    for sharded in (False, True):
        torch._dynamo.reset()
        model = build_model("frozen_norm")
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        if sharded:
            config = ZeroConfig(stage=stage)
            gatherer = shard_module(model, config, dist.group.WORLD, torch.device("cpu")) if stage == 3 else None
            optimizer = ZeroOptimizer(model, optimizer, dist.group.WORLD, config, gatherer)
            forward = torch.compile(model)
        else:
            forward = torch.compile(DistributedDataParallel(model))
        losses = []
        for step in range(3):
            loss = loss_fn("frozen_norm", forward, batch("frozen_norm", dist.get_rank(), step, 0))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        runs.append(losses)
    return runs


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_torch_compile_matches_ddp_with_compile(stage):
    for reference, compiled in run_distributed(_compiled_runs, 2, stage, timeout=280):
        torch.testing.assert_close(torch.tensor(compiled), torch.tensor(reference), rtol=1e-4, atol=1e-5)


class _ListOfLayers(torch.nn.Module):
    """Layers of different classes in a ``ModuleList`` the parent iterates: the list itself is never called."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 8)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return x


def _sharded_and_plain_outputs(config: ZeroConfig) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    plain = _ListOfLayers()
    torch.manual_seed(0)
    sharded = _ListOfLayers()
    gatherer = shard_module(sharded, config, dist.group.WORLD, torch.device("cpu"))
    x = torch.randn(3, 8)
    return [u.name for u in gatherer.units], sharded(x).detach(), plain(x).detach()


@pytest.mark.timeout(60)
def test_a_container_without_a_forward_is_never_a_unit():
    """The size threshold once made the ``ModuleList`` (144 elements, above 100; each layer is 72) a unit: nothing
    calls a list, so its gather never ran and the layers computed with placeholders. Its parameters now stay in the
    enclosing unit."""
    config = ZeroConfig(stage=3, wrap_module_classes=(), wrap_min_numel=100)
    for units, sharded, plain in run_distributed(_sharded_and_plain_outputs, 2, config):
        assert units == ["<root>"]
        torch.testing.assert_close(sharded, plain, rtol=0, atol=0)
