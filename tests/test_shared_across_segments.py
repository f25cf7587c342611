"""A parameter used in several activation-checkpoint segments (weight sharing across depth): DDP's numbers under
every stage, and every bucket reduced exactly once per step.

Under reentrant checkpointing each segment's recomputation runs a backward of its own, so the post-accumulate-grad
hook of a parameter used in k segments fires k times in one backward (Note [final gradients] in
``lightning_zero/sharding/gradient_arrivals.py``). DDP refuses that case (a parameter marked ready twice), so the
reference is DDP on the same model without checkpointing: the same mathematics.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, Literal

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import Tensor, nn

from lightning_zero import ZeroConfig
from lightning_zero.comm.pending_collective import Collective
from lightning_zero.sharding.flat_bucket import FlatBucket
from lightning_zero.sharding.gradient_arrivals import GradientArrivals, in_nested_backward
from tests.harness import DistributedTestError, run_distributed
from tests.parity import (
    Run,
    assert_runs_match,
    ddp,
    full_weights,
    native_collectives_on,
    optimizer_no_sync,
    zero,
    zero3,
)

Checkpointing = Literal["none", "reentrant", "non_reentrant"]
Kind = Literal["albert", "looped", "albert_tail"]
VOCAB, WIDTH = 48, 24


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(self.up(self.norm(x)).tanh())


class SharedDepthLM(nn.Module):
    """``albert``: one block applied at every depth (ALBERT's cross-layer sharing). ``looped``: a block looped
    between unshared ones, so buckets reduced after the shared one wait on its last use. Every application of the
    shared block is its own checkpoint segment (unless ``checkpointing="none"``), except in ``albert_tail``, which
    applies it once more outside them, last."""

    def __init__(self, kind: Kind, checkpointing: Checkpointing, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.before = Block() if kind == "looped" else nn.Identity()
        self.shared = Block()
        self.after = Block() if kind == "looped" else nn.Identity()
        self.head = nn.Linear(WIDTH, VOCAB)
        self.depth = depth
        self.kind = kind
        self.checkpointing = checkpointing

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.before(self.embed(tokens))
        for _ in range(self.depth):
            if self.checkpointing == "none":
                x = self.shared(x)
            else:
                x = torch.utils.checkpoint.checkpoint(self.shared, x, use_reentrant=self.checkpointing == "reentrant")
        if self.kind == "albert_tail":
            x = self.shared(x)
        out: Tensor = self.head(self.after(x))
        return out


def _batch(rank: int, step: int, micro: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(10_000 * rank + 100 * step + micro)
    tokens = torch.randint(0, VOCAB, (4, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _train(
    kind: Kind,
    checkpointing: Checkpointing,
    wrap: Callable[[nn.Module, torch.optim.Optimizer], tuple[nn.Module, Any]],
    steps: int,
    accumulate: int,
    build: Callable[[Kind, Checkpointing], nn.Module] = SharedDepthLM,
) -> Run:
    """``steps`` optimizer steps of ``accumulate`` micro-batches; ``extra["reductions"]``: per step, how many
    reduce-scatters the gradient reducer issued, and ``extra["buckets"]`` how many buckets it has."""
    torch.manual_seed(1234)
    model = build(kind, checkpointing)
    trainable = [p for p in model.parameters() if p.requires_grad]
    forward, optimizer = wrap(model, torch.optim.AdamW(trainable, lr=3e-3))
    ledger = getattr(optimizer, "ledger", None)
    run = Run()
    run.extra["reductions"] = []
    for step in range(steps):
        before = 0 if ledger is None else ledger.calls.get(Collective.REDUCE_SCATTER, 0)
        optimizer.zero_grad()
        total = 0.0
        for micro in range(accumulate):
            last = micro == accumulate - 1
            with optimizer_no_sync(forward, optimizer) if not last else nullcontext():
                x, y = _batch(dist.get_rank(), step, micro)
                loss = nn.functional.cross_entropy(forward(x).flatten(0, 1), y.flatten()) / accumulate
                loss.backward()
            total += loss.item()
        optimizer.step()
        run.losses.append(total)
        if ledger is not None:
            run.extra["reductions"].append(ledger.calls.get(Collective.REDUCE_SCATTER, 0) - before)
    if ledger is not None:
        reducer = optimizer.reducer
        run.extra["buckets"] = len(reducer.buckets)
        run.extra["expected"] = {
            slot.fqn: reducer.arrivals.expected[reducer.arrivals.position(bucket.index, i)]
            for bucket in reducer.buckets
            for i, slot in enumerate(bucket.slots)
        }
    run.weights = full_weights(model, optimizer)
    return run


def _reference_and_zero(kind: Kind, checkpointing: Checkpointing, config: ZeroConfig, accumulate: int) -> list[Run]:
    """DDP without checkpointing, then ZeRO with ``checkpointing``, on gloo's path and on the native one."""
    return [_reference(kind, accumulate), *_zero_runs(kind, checkpointing, config, accumulate)]


def _reference(kind: Kind, accumulate: int) -> Run:
    return _train(kind, "none", ddp, 3, accumulate)


def _zero_runs(kind: Kind, checkpointing: Checkpointing, config: ZeroConfig, accumulate: int) -> list[Run]:
    wrap = zero3(config) if config.stage == 3 else zero(config)
    runs = [_train(kind, checkpointing, wrap, 3, accumulate)]
    with native_collectives_on():
        runs.append(_train(kind, checkpointing, wrap, 3, accumulate))
    return runs


@functools.cache
def _shared_reference(kind: Kind, accumulate: int) -> list[Run]:
    """Each rank's DDP run: the same for every stage, checkpointing and accumulation mode, so trained once."""
    return run_distributed(_reference, 2, kind, accumulate)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize(
    ("kind", "checkpointing", "accumulate", "grad_accumulation"),
    [("albert", "reentrant", 1, "sharded"), ("looped", "reentrant", 1, "sharded"),
     ("looped", "reentrant", 2, "local"), ("looped", "reentrant", 2, "sharded"),
     ("albert", "non_reentrant", 1, "sharded")],
)  # fmt: skip
def test_a_parameter_shared_across_checkpoint_segments_gets_ddps_gradient_reduced_once(
    stage, kind, checkpointing, accumulate, grad_accumulation
):
    # Small buckets: several of them, some mixing the shared block's parameters with unshared ones.
    config = ZeroConfig(stage=stage, bucket_numel=1_500, grad_accumulation=grad_accumulation)
    per_step = accumulate if stage > 1 and grad_accumulation == "sharded" else 1  # reducing backward passes
    uses = 3 if checkpointing == "reentrant" else 1  # hook calls per backward of the shared block's parameters
    ranks = run_distributed(_zero_runs, 2, kind, checkpointing, config, accumulate)
    for reference, runs in zip(_shared_reference(kind, accumulate), ranks, strict=True):
        for run in runs:  # gloo's collectives, then the native ones
            assert_runs_match(reference, run)
            # Exactly one reduce-scatter per bucket and reducing backward, however many segments used a parameter.
            assert run.extra["reductions"] == [run.extra["buckets"] * per_step] * len(reference.losses)
            expected = run.extra["expected"]
            assert {n: c for n, c in expected.items() if n.startswith("shared.")} == dict.fromkeys(
                (n for n in expected if n.startswith("shared.")), uses
            )
            assert all(c == 1 for n, c in expected.items() if not n.startswith("shared."))


def _frozen_base(kind: Kind, checkpointing: Checkpointing) -> nn.Module:
    """LoRA's shape: everything frozen but the shared block's last bias; the frozen embedding's output made to
    require grad (as Hugging Face's ``enable_input_require_grads``) so that gradients reach the segments."""
    model = SharedDepthLM(kind, checkpointing)
    for name, param in model.named_parameters():
        param.requires_grad_(name == "shared.down.bias")
    model.embed.register_forward_hook(lambda module, args, out: out.requires_grad_(True))
    return model


def _frozen_base_runs(config: ZeroConfig, checkpointing: Checkpointing) -> list[Run]:
    steps = 3
    reference = _train("albert", "none", ddp, steps, 1, build=_frozen_base)
    return [reference, _train("albert", checkpointing, zero3(config), steps, 1, build=_frozen_base)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("units", "checkpointing"),
    [(("Block",), "reentrant"), (None, "reentrant"), (None, "none")],
    ids=["block-unit", "root-only", "root-only-no-checkpointing"],
)
def test_a_frozen_shared_block_stays_gathered_until_its_last_segments_backward_is_over(units, checkpointing):
    # Each segment's recomputation backward reads the block's frozen weights for its input's gradient after the
    # trainable bias's last gradient has arrived: the unit must not be freed on that arrival (Note [post-backward]).
    # Without checkpointing, the root's backward does the same for the embedding output made to require grad.
    config = ZeroConfig(stage=3, wrap_module_classes=units)
    torch.manual_seed(1234)
    initial = SharedDepthLM("albert", "none").shared.down.bias.detach().clone()
    for reference, run in run_distributed(_frozen_base_runs, 2, config, checkpointing):
        assert_runs_match(reference, run)
        assert not torch.equal(run.weights["shared.down.bias"], initial), "the adapter got no gradient"


def _train_zero(kind: Kind, checkpointing: Checkpointing, config: ZeroConfig) -> Run:
    return _train(kind, checkpointing, zero3(config) if config.stage == 3 else zero(config), 2, 1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", [1, 2])
def test_a_gradient_arriving_after_its_bucket_was_reduced_is_an_error_naming_the_parameter(stage):
    # The shared block's last use is outside the segments: its gradient from there arrives first, in the step's own
    # backward, and makes it final as far as the first backward can tell; the segments' recomputations bring more.
    # DDP refuses this model too (a parameter marked ready twice).
    config = ZeroConfig(stage=stage, bucket_numel=1)  # one bucket per parameter: nothing else holds them back
    with pytest.raises(DistributedTestError, match=r"'shared\.\S+' received a gradient after its bucket was reduced"):
        run_distributed(_train_zero, 2, "albert_tail", "reentrant", config, timeout=60)
    # Non-reentrant checkpointing, as the error's HINT says, gives DDP's numbers.
    for reference, *runs in run_distributed(_reference_and_zero, 2, "albert_tail", "non_reentrant", config, 1):
        for run in runs:
            assert_runs_match(reference, run)


def test_hooks_of_a_reentrant_segments_recomputation_run_in_a_nested_backward():
    seen: dict[str, list[bool]] = {"shared": [], "head": []}
    model = SharedDepthLM("albert", "reentrant", depth=2)
    for name in seen:
        for p in getattr(model, name).parameters():
            p.register_post_accumulate_grad_hook(lambda _, name=name: seen[name].append(in_nested_backward()))
    model(_batch(0, 0, 0)[0]).sum().backward()
    assert seen["head"] == [False, False]  # the step's own backward
    assert seen["shared"] == [True] * 2 * len(list(model.shared.parameters()))  # each segment's, twice


def test_a_bucket_is_final_when_each_parameter_had_its_learned_number_of_gradients():
    buckets = [FlatBucket(0, 0, [("a", nn.Parameter(torch.ones(2))), ("b", nn.Parameter(torch.ones(2)))], 0, 1)]
    arrivals = GradientArrivals(buckets)
    a, b = arrivals.position(0, 0), arrivals.position(0, 1)
    assert not arrivals.arrive(0, a)
    assert arrivals.arrive(0, b)
    assert not arrivals.arrive(0, a)  # a second call of a, counted
    arrivals.learn(arrivals.calls().tolist())
    assert arrivals.expected == [2, 1]
    arrivals.reset()
    assert not arrivals.arrive(0, b)
    assert not arrivals.arrive(0, a)
    assert not arrivals.launchable(0)
    assert arrivals.arrive(0, a)
    assert arrivals.launchable(0)


class _AbortError(Exception):
    pass


def _with_aborted_backward(stage: int, abort: bool) -> Run:
    """Three steps of the ALBERT-style model; with ``abort``, a backward raising near its end (every rank, after
    most buckets were launched) precedes step 1, and ``zero_grad()`` discards what it left."""
    torch.manual_seed(1234)
    model = SharedDepthLM("albert", "reentrant")
    config = ZeroConfig(stage=stage, bucket_numel=1_500)
    _, optimizer = zero(config)(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    run = Run()
    for step in range(3):
        if step == 1 and abort:
            x, y = _batch(dist.get_rank(), 99, 0)
            embedded = model.embed(x)

            def fail(grad: Tensor) -> Tensor:
                raise _AbortError

            embedded.register_hook(fail)  # the embedding's gradient is backward's last
            hidden = embedded
            for _ in range(model.depth):
                hidden = torch.utils.checkpoint.checkpoint(model.shared, hidden, use_reentrant=True)
            with pytest.raises(_AbortError):
                nn.functional.cross_entropy(model.head(hidden).flatten(0, 1), y.flatten()).backward()
        optimizer.zero_grad()
        x, y = _batch(dist.get_rank(), step, 0)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        run.losses.append(loss.item())
    run.weights = full_weights(model, optimizer)
    return run


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_grad_after_a_backward_that_raised_starts_the_next_one_afresh(stage):
    aborted = run_distributed(_with_aborted_backward, 2, stage, True, timeout=60)
    plain = run_distributed(_with_aborted_backward, 2, stage, False, timeout=60)
    for run, reference in zip(aborted, plain, strict=True):
        assert_runs_match(reference, run)
