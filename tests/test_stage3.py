"""ZeRO stage 3: parameters sharded, gathered around forward and backward; still DDP's mathematics."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_zero import RankDivergenceError, ZeroConfig, ZeroOptimizer, expected_model_state_bytes, shard_module
from lightning_zero.engine.memory import model_state_bytes
from lightning_zero.models.gpt import GPT, GPTConfig
from lightning_zero.stage3.sharded_unit import UnitState
from tests.harness import run_distributed
from tests.parity import assert_runs_match, assert_zero_matches_ddp, ddp_and_zero

CPU = torch.device("cpu")


MODELS = [("gpt", "adamw"), ("transformer", "adamw"), ("gpt_checkpointed", "adamw"), ("mlp", "sgd")]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("model", "optimizer", "world_size"),
    [
        # 4-6 s each: one rank, every shard its own, no collective with two sides; mlp-sgd-1, and every model at 2
        # and 4 ranks, run by default.
        pytest.param(model, optimizer, world_size, marks=pytest.mark.slow if world_size == 1 and model != "mlp" else ())
        for model, optimizer in MODELS
        for world_size in (1, 2, 4)
    ],
)
def test_stage3_matches_ddp(model, optimizer, world_size):
    # "gpt" ties its input embedding and output projection; "transformer" is nn.TransformerEncoder, whose attention
    # reads out_proj.weight outside out_proj's forward; "gpt_checkpointed" recomputes each block in backward.
    assert_zero_matches_ddp(world_size, model, optimizer, 10, 1, ZeroConfig(stage=3))


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "config",
    [
        ZeroConfig(stage=3, prefetch_limit_numel=0),
        ZeroConfig(stage=3, wrap_module_classes=(), wrap_min_numel=500),  # size policy; never splits attention
        ZeroConfig(stage=3, persistence_threshold=100, check_rank_divergence=False),
        ZeroConfig(stage=3, overlap_comm=False, max_inflight_buckets=1),
        ZeroConfig(stage=3, reshard_root_after_forward=False),
    ],
    ids=["no-prefetch", "size-policy", "persistent-small-params", "no-overlap", "root-kept-into-backward"],
)
def test_stage3_options_match_ddp(config):
    for model in ("transformer", "gpt"):
        assert_zero_matches_ddp(2, model, "adamw", 6, 2, config)


def _sharded_init() -> tuple[bool, dict[str, float], list[str]]:
    config = GPTConfig.tiny(n_layer=3)
    torch.manual_seed(3)
    direct = GPT(config)
    rng_after_direct = torch.get_rng_state()
    torch.manual_seed(3)
    with torch.device("meta"):
        model = GPT(config)
    gatherer = shard_module(model, ZeroConfig(stage=3), dist.group.WORLD, CPU)
    same_rng = torch.equal(torch.get_rng_state(), rng_after_direct)
    reference = dict(direct.named_parameters())
    with gatherer.gathered():
        diff = {n: (p - reference[n]).abs().max().item() for n, p in model.named_parameters()}
    return same_rng, diff, [u.name for u in gatherer.units]


@pytest.mark.timeout(60)
def test_sharded_init_gives_the_weights_and_rng_state_of_direct_construction():
    for same_rng, diff, units in run_distributed(_sharded_init, 2):
        assert units == ["<root>", "blocks.0", "blocks.1", "blocks.2"]
        assert diff
        assert all(d == 0.0 for d in diff.values()), diff
        assert same_rng


def _state_and_bytes(
    world_size: int, config: ZeroConfig | None = None
) -> tuple[int, object, object, int, dict[str, int], list[str]]:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(GPTConfig.tiny(n_layer=4, n_embd=64, vocab_size=128))
    config = config or ZeroConfig(stage=3)
    gatherer = shard_module(model, config, dist.group.WORLD, CPU)
    optimizer = ZeroOptimizer(model, torch.optim.AdamW(model.parameters()), dist.group.WORLD, config, gatherer)
    num_params = sum(b.numel for u in gatherer.units for b in u.buckets)
    padding = sum(b.padded_numel - b.numel for u in gatherer.units for b in u.buckets)
    for _ in range(2):
        optimizer.zero_grad()  # frees the gradient shards until the next reduction (as torch frees .grad)
        tokens = torch.randint(0, 128, (2, 17))
        model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.step()
    states = [u.state.value for u in gatherer.units]
    measured = model_state_bytes(model, [optimizer], gatherer)
    expected = expected_model_state_bytes(num_params, world_size, 3, param_bytes=4, master_bytes=0)
    return num_params, measured, expected, padding, optimizer.ledger.last_step_bytes(), states


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
def test_stage3_model_state_is_16_psi_over_n_and_traffic_is_3_psi(world_size):
    for num_params, measured, expected, padding, sent, states in run_distributed(
        _state_and_bytes, world_size, world_size
    ):
        # (4 + 4 + 8)Ψ/N for fp32 AdamW, within padding (< N elements per bucket).
        slack = 16 * padding // world_size
        assert expected.total == 16 * num_params // world_size
        assert expected.total <= measured.total <= expected.total + slack, (measured, expected)
        assert measured.master_weights == 0
        # Per step: all-gather before forward and before backward, reduce-scatter after backward: 3Ψ(N-1)/N.
        padded = num_params + padding
        one_way = 4 * padded * (world_size - 1) // world_size
        # Plus one tiny all-reduce: which parameters got a gradient (Note [unused parameters]).
        assert 0 < sent.pop("all_reduce") < one_way // 100
        assert sent == {"all_gather": 2 * one_way, "reduce_scatter": one_way}
        assert set(states) == {"sharded"}  # nothing stays gathered between steps


def _root_numel_and_bytes() -> tuple[int, int, dict[str, int], dict[str, int], list[str]]:
    """Bytes of a step with the root resharded after forward and with it kept into backward, same model."""
    sent = {}
    for reshard in (True, False):
        *_, last, states = _state_and_bytes(
            dist.get_world_size(), ZeroConfig(stage=3, reshard_root_after_forward=reshard)
        )
        sent[reshard] = last
    with torch.device("meta"):
        model = GPT(GPTConfig.tiny(n_layer=4, n_embd=64, vocab_size=128))
    root = shard_module(model, ZeroConfig(stage=3), dist.group.WORLD, CPU).units[0]
    return root.numel, dist.get_world_size(), sent[True], sent[False], states


@pytest.mark.timeout(120)
def test_keeping_the_root_gathered_into_backward_saves_exactly_its_second_gather():
    for root_numel, world_size, resharded, kept, states in run_distributed(_root_numel_and_bytes, 2):
        root_gather = 4 * root_numel * (world_size - 1) // world_size
        assert root_gather > 0
        assert kept["reduce_scatter"] == resharded["reduce_scatter"]
        assert kept["all_gather"] == resharded["all_gather"] - root_gather
        assert set(states) == {"sharded"}  # kept only into backward: freed when it ends


def _shard_bytes_around_zero_grad(stage: int) -> tuple[int, int, int, int]:
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny(n_layer=2, n_embd=64, vocab_size=128))
    config = ZeroConfig(stage=stage)
    gatherer = shard_module(model, config, dist.group.WORLD, CPU) if stage == 3 else None
    optimizer = ZeroOptimizer(model, torch.optim.AdamW(model.parameters()), dist.group.WORLD, config, gatherer)
    tokens = torch.randint(0, 128, (2, 17))
    model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    optimizer.step()
    after_step = optimizer.reducer.state_bytes()
    optimizer.zero_grad(set_to_none=False)
    kept = optimizer.reducer.state_bytes()
    optimizer.zero_grad()
    freed = optimizer.reducer.state_bytes()
    assert all(p.grad is None for p in model.parameters())
    model.loss(tokens[:, :-1], tokens[:, 1:]).backward()  # the next reduction allocates them again
    optimizer.step()
    return after_step, kept, freed, optimizer.reducer.state_bytes()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_grad_frees_gradients_as_torch_frees_grads(stage):
    # Note [gradient shards between steps], Note [full gradients between steps]: the forward runs without them.
    for after_step, kept, freed, next_step in run_distributed(_shard_bytes_around_zero_grad, 2, stage):
        assert after_step > 0
        assert kept == after_step
        assert freed == 0
        assert next_step == after_step


class _Branching(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if i == 1 and dist.get_rank() == 1:
                continue  # a data-dependent skip that only rank 1 takes
            x = layer(x)
        return x


def _branching_runs() -> list[dict[str, torch.Tensor]]:
    """The same steps of ``_Branching`` under DDP (find_unused_parameters) and stage 3; plain SGD, so that a layer
    with a zero gradient stays put under both."""
    results = []
    for sharded in (False, True):
        torch.manual_seed(0)
        model = _Branching()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        if sharded:
            gatherer = shard_module(model, ZeroConfig(stage=3), dist.group.WORLD, CPU)
            optimizer = ZeroOptimizer(model, optimizer, dist.group.WORLD, ZeroConfig(stage=3), gatherer)
            forward = model
        else:
            forward = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        for step in range(3):
            x = torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * dist.get_rank() + step))
            forward(x).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        context = gatherer.gathered() if sharded else contextlib.nullcontext()
        with context:
            results.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return results


@pytest.mark.timeout(60)
def test_a_layer_only_some_ranks_run_is_reconciled_and_matches_ddp():
    # Rank 1 skips layers.1 in every step: the first step's rounds gather it on both ranks, and it is merged into
    # the root unit from then on (Note [data-dependent units]).
    for reference, sharded in run_distributed(_branching_runs, 2, collective_timeout=20):
        for name, expected in reference.items():
            torch.testing.assert_close(sharded[name], expected, rtol=1e-5, atol=1e-6, msg=name)


class _RareBranch(nn.Module):
    """``rare`` runs on rank 1 only, and only once ``take_rare`` is set: after the order was recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.rare = nn.Linear(4, 4)
        self.take_rare = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i == 0 and self.take_rare and dist.get_rank() == 1:
                x = self.rare(x)
        return x


def _diverge_after_prefetching_started() -> str:
    model = _RareBranch()
    shard_module(model, ZeroConfig(stage=3, wrap_module_classes=("Linear",)), dist.group.WORLD, CPU)
    for step in range(3):
        model.take_rare = step == 2
        try:
            model(torch.randn(2, 4)).sum().backward()
        except RankDivergenceError as error:
            return f"step {step}: {error}"
    return "no error"


@pytest.mark.timeout(60)
def test_rank_divergence_is_caught_when_later_steps_prefetch():
    messages = run_distributed(_diverge_after_prefetching_started, 2, collective_timeout=20)
    for message in messages:
        assert message.startswith("step 2: "), messages
        assert "rank 1: 'rare'" in message
        assert "HINT" in message


def _gathered_context() -> tuple[list[int], list[int], float, float]:
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny(n_layer=2))
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    gatherer = shard_module(model, ZeroConfig(stage=3), dist.group.WORLD, CPU)
    outside = [p.untyped_storage().nbytes() for p in model.parameters()]
    shapes = [p.shape for p in model.parameters()]
    with gatherer.gathered():
        inside = [p.untyped_storage().nbytes() for p in model.parameters()]
        exact = max((p - full[n]).abs().max().item() for n, p in model.named_parameters())
    assert shapes == [t.shape for t in full.values()]  # placeholders keep the shape
    with gatherer.gathered(model.blocks[1], writeback=True), torch.no_grad():
        model.blocks[1].mlp.fc.weight.mul_(2.0)  # e.g. loading an EMA copy
    with gatherer.gathered():
        kept = (model.blocks[1].mlp.fc.weight - 2.0 * full["blocks.1.mlp.fc.weight"]).abs().max().item()
    assert all(u.state is UnitState.SHARDED for u in gatherer.units)
    return outside, inside, exact, kept


@pytest.mark.timeout(60)
def test_gathered_context_shows_full_parameters_and_restores_the_sharded_state():
    for outside, inside, exact, kept in run_distributed(_gathered_context, 2):
        assert set(outside) == {4}  # one fp32 element per bucket outside any use
        assert all(n > 4 for n in inside)
        assert exact == 0.0
        assert kept == 0.0  # writeback=True kept the change


def _eval_forward() -> tuple[float, dict[str, int], list[str]]:
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny(n_layer=2))
    tokens = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        expected = model.loss(tokens[:, :-1], tokens[:, 1:]).item()
    gatherer = shard_module(model, ZeroConfig(stage=3), dist.group.WORLD, CPU)
    with torch.no_grad():
        got = model.loss(tokens[:, :-1], tokens[:, 1:]).item()
    gatherer.ledger.end_step()
    return got - expected, gatherer.ledger.last_step_bytes(), [u.state.value for u in gatherer.units]


@pytest.mark.timeout(60)
def test_inference_gathers_and_frees_without_gradient_work():
    for diff, sent, states in run_distributed(_eval_forward, 2):
        assert diff == 0.0
        assert set(sent) == {"all_gather"}  # no reduce-scatter, no backward gathers
        assert set(states) == {"sharded"}


@pytest.mark.timeout(120)
def test_stage3_unit_recomputed_in_backward_matches_ddp():
    # The unit is the checkpointed Block itself: backward re-runs its forward, which must neither free it
    # afterwards nor hook its outputs again (Note [recomputation]).
    config = ZeroConfig(stage=3, wrap_module_classes=("Block",))
    for reference, sharded in run_distributed(ddp_and_zero, 2, "gpt_checkpointed", "adamw", 8, 1, config):
        assert_runs_match(reference, sharded)


class _ReadsWithoutCalling(nn.Module):
    """A root whose forward sometimes skips its layers: the prefetched first layer is then never used."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 4)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.head(x)
        if not self.skip:
            for layer in self.layers:
                x = layer(x)
        return x


def _prefetched_but_unused() -> list[str]:
    model = _ReadsWithoutCalling()
    gatherer = shard_module(model, ZeroConfig(stage=3), dist.group.WORLD, CPU)
    model(torch.randn(2, 4)).sum().backward()  # records the forward order: root, layers.0, layers.1
    model.skip = True
    with torch.no_grad():
        model(torch.randn(2, 4))  # the root's pre-forward prefetches layers.0, which this forward never calls
    return [u.state.value for u in gatherer.units]


@pytest.mark.timeout(60)
def test_a_prefetched_unit_the_forward_never_used_is_freed_when_the_root_forward_ends():
    for states in run_distributed(_prefetched_but_unused, 2):
        assert set(states) == {"sharded"}, states


def _gathers_with_kept_memory(reuse: bool) -> dict[str, object]:
    """Three steps of a 4-block GPT; the third is counted: gathers served by kept memory, memory kept at the end of
    its forward and backward, and the losses."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(GPTConfig.tiny(n_layer=4, n_embd=64, vocab_size=128))
    config = ZeroConfig(stage=3)
    gatherer = shard_module(model, config, dist.group.WORLD, CPU)
    gatherer.buffers.enabled = reuse
    optimizer = ZeroOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), dist.group.WORLD, config, gatherer)
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(dist.get_rank()))
    losses, kept_after_forward, kept_after_backward, reused = [], [], [], 0
    for _ in range(3):
        reused = gatherer.buffers.reused
        optimizer.zero_grad()
        loss = model.loss(tokens[:, :-1], tokens[:, 1:])
        kept_after_forward.append(gatherer.buffers.nbytes())
        loss.backward()
        kept_after_backward.append(gatherer.buffers.nbytes())
        optimizer.step()
        losses.append(loss.item())
    with gatherer.gathered():
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {
        "reused": gatherer.buffers.reused - reused,
        "kept": kept_after_forward + kept_after_backward,
        "losses": losses,
        "weights": weights,
        "states": [u.state.value for u in gatherer.units],
    }


@pytest.mark.timeout(90)
def test_gathers_reuse_released_memory_within_a_pass_and_nothing_changes():
    # Note [gathered buffers reused]: of 4 equal blocks, the third and fourth of each pass take the memory of the
    # first and second (prefetching keeps two gathered at once); the root and the first two allocate.
    runs = [run_distributed(_gathers_with_kept_memory, 2, reuse) for reuse in (True, False)]
    for with_reuse, without in zip(*runs, strict=True):
        assert with_reuse["reused"] == 4
        assert without["reused"] == 0
        assert with_reuse["kept"] == [0] * 6  # nothing kept past a forward or a backward
        assert with_reuse["losses"] == without["losses"]
        for name, value in with_reuse["weights"].items():
            assert torch.equal(value, without["weights"][name]), name
        assert set(with_reuse["states"]) == {"sharded"}
