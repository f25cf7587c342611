"""The collectives on gloo (pairwise reduce-scatter and all-gather) against their definitions, and the pool of
buffers the gradient reduction reuses."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from lightning_zero import ZeroConfig, ZeroOptimizer, shard_module
from lightning_zero.comm.buffer_pool import BufferPool
from lightning_zero.comm.collectives import (
    NATIVE_COLLECTIVES_ENV,
    all_gather,
    native_collectives,
    receive_buffer_numel,
    reduce_scatter,
    reduce_scatter_pieces,
)
from lightning_zero.models.gpt import GPT, GPTConfig
from tests.harness import run_distributed

SHARD = 1000


def _contribution(rank: int, world: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randn(world * SHARD, generator=generator).to(dtype)


def _reduce_scatter(dtype_name: str, with_scratch: bool, in_place: bool) -> bool:
    dtype = getattr(torch, dtype_name)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = _contribution(rank, world, dtype)
    chunks = [_contribution(r, world, dtype)[rank * SHARD : (rank + 1) * SHARD] for r in range(world)]
    expected = torch.stack(chunks).float().mean(0)
    in_order = chunks[0].clone()  # Note [reduce-scatter on gloo]: summed in rank order, then divided
    for chunk in chunks[1:]:
        in_order.add_(chunk)
    output = mine[rank * SHARD : (rank + 1) * SHARD] if in_place else torch.full((SHARD,), float("nan"), dtype=dtype)
    native = native_collectives()  # the whole session's mode (Note [native collectives])
    spare = receive_buffer_numel(output, mine, dist.group.WORLD)
    if native:  # one call into torch, which needs no receive buffer of ours
        assert spare == 0
    else:
        assert spare == (world - 1 if in_place else world - 2) * SHARD  # none at all for two ranks, out of place
    scratch = torch.full((spare,), float("nan"), dtype=dtype) if with_scratch and spare else None
    pending = reduce_scatter(output, mine, dist.group.WORLD, scratch=scratch)
    assert pending.bytes_sent == (world - 1) * SHARD * mine.element_size()
    if native:
        assert [send.op for send in pending.sends] == ["reduce_scatter_single"], pending.sends
    pending.wait()
    tolerance = {torch.float32: 1e-6, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(output.float(), expected, rtol=tolerance, atol=tolerance)
    if dtype != torch.float16 and not native:  # fp16 is divided before the sum (Note [when to average])
        assert torch.equal(output, in_order.div_(world))  # gloo's own order; the native op sums in its own
    return True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("in_place", [False, True], ids=["out-of-place", "in-place"])
def test_reduce_scatter_averages_this_ranks_shard(world_size, dtype_name, in_place):
    assert all(run_distributed(_reduce_scatter, world_size, dtype_name, world_size == 4, in_place))


def _pieces_against_flat(dtype_name: str) -> bool:
    """The input cut into uneven pieces (a piece may straddle no chunk boundary) reduces bit for bit as the flat
    input does (Note [gradients sent from where autograd put them])."""
    dtype = getattr(torch, dtype_name)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = _contribution(rank, world, dtype)
    flat = torch.empty(SHARD, dtype=dtype)
    reduce_scatter(flat, mine.clone(), dist.group.WORLD).wait()
    cuts = [
        0,
        1,
        7,
        300,
        999,
        1000,
        1001,
        1500,
        2600,
        2999,
        3000,
        3001,
        3999,
    ]  # chunk boundaries are multiples of SHARD
    edges = sorted({c for c in cuts if c < world * SHARD} | {SHARD * r for r in range(world + 1)})
    chunks: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for start, end in itertools.pairwise(edges):
        chunks[start // SHARD].append(mine[start:end].clone())  # separate tensors, as gradients are
    spare = (world - 2) * SHARD
    scratch = torch.full((spare,), float("nan"), dtype=dtype) if spare else None
    output = torch.full((SHARD,), float("nan"), dtype=dtype)
    pending = reduce_scatter_pieces(output, chunks, dist.group.WORLD, scratch=scratch)
    assert pending.bytes_sent == (world - 1) * SHARD * mine.element_size()
    assert len(pending.sends) == sum(len(chunks[r]) for r in range(world) if r != rank)
    pending.wait()
    assert torch.equal(output, flat)
    return True


@pytest.mark.skipif(
    native_collectives(),
    reason="reduce_scatter_pieces is gloo's pairwise form only; the native branch reduces a flat staged bucket "
    "(takes_pieces is False), and its reduce-scatter sums in an order of its own",
)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_reduce_scatter_of_pieces_equals_the_flat_reduce_scatter(world_size, dtype_name):
    assert all(run_distributed(_pieces_against_flat, world_size, dtype_name))


def _fp16_near_max() -> list[float]:
    # Every rank holds 40000: the average is representable in fp16, the sum of 2 (80000 > 65504) is not.
    world = dist.get_world_size()
    output = torch.empty(SHARD, dtype=torch.float16)
    reduce_scatter(output, torch.full((world * SHARD,), 40000.0, dtype=torch.float16), dist.group.WORLD).wait()
    return [output.min().item(), output.max().item()]


@pytest.mark.timeout(60)
def test_fp16_gradients_are_averaged_before_summing_so_they_cannot_overflow():
    for low, high in run_distributed(_fp16_near_max, 2):
        assert low == high == 40000.0


def _all_gather(in_place: bool) -> bool:
    rank, world = dist.get_rank(), dist.get_world_size()
    full = torch.full((world * SHARD,), float("nan"))
    shard = torch.arange(SHARD, dtype=torch.float32) + 10_000 * rank
    if in_place:
        full[rank * SHARD : (rank + 1) * SHARD].copy_(shard)
        shard = full[rank * SHARD : (rank + 1) * SHARD]
    pending = all_gather(full, shard, dist.group.WORLD)
    assert pending.bytes_sent == (world - 1) * SHARD * 4
    pending.wait()
    expected = torch.cat([torch.arange(SHARD, dtype=torch.float32) + 10_000 * r for r in range(world)])
    assert torch.equal(full, expected)
    return True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("in_place", [True, False])
def test_all_gather_puts_every_shard_in_rank_order(world_size, in_place):
    assert all(run_distributed(_all_gather, world_size, in_place))


def _every_case() -> bool:
    for dtype_name, in_place in itertools.product(("float32", "bfloat16", "float16"), (False, True)):
        _reduce_scatter(dtype_name, False, in_place)
    return all(_all_gather(in_place) for in_place in (False, True))


@pytest.mark.timeout(120)
def test_the_native_branch_averages_and_gathers_every_case_on_four_ranks():
    # The cases above take the session's mode (gloo's forms by default); NCCL's branch gets them all in one launch,
    # in place (stage 1's reduction into its own chunk) and fp16's divide-first included (Note [native collectives]).
    assert all(run_distributed(_every_case, 4, env={NATIVE_COLLECTIVES_ENV: "1"}))


def test_buffer_pool_reuses_buffers_within_size_classes():
    cpu = torch.device("cpu")
    pool = BufferPool()
    for numel in (100, 110, 300):  # Note [size classes]: 100 and 110 share a class of 110, 300 is one of its own
        pool.reserve(numel, torch.float32, cpu)
    first = pool.take(100, torch.float32, cpu)
    assert first.numel() == 100
    assert pool.nbytes() == 110 * 4
    address = first.data_ptr()
    pool.give(first)
    again = pool.take(105, torch.float32, cpu)
    assert again.data_ptr() == address  # the same buffer serves every size of its class
    other = pool.take(100, torch.float32, cpu)  # the first is lent: a second buffer of the class
    assert other.data_ptr() != address
    assert pool.lent() == 2
    large = pool.take(250, torch.float32, cpu)
    assert pool.nbytes() == (2 * 110 + 300) * 4
    for view in (again, other, large):
        pool.give(view)
    assert pool.take(300, torch.float32, cpu).data_ptr() == large.data_ptr()
    assert pool.take(110, torch.float32, cpu).data_ptr() in (again.data_ptr(), other.data_ptr())
    assert pool.nbytes() == (2 * 110 + 300) * 4  # nothing new was allocated
    huge = pool.take(1000, torch.float32, cpu)  # larger than every class: a class of its own
    assert huge.numel() == 1000
    small = pool.take(10, torch.bfloat16, cpu)  # pooled per dtype
    assert small.dtype == torch.bfloat16
    pool.clear()
    assert pool.nbytes() == (300 + 110 + 1000) * 4 + 10 * 2  # only the lent ones remain
    assert pool.lent() == 4


def _reducer_buffers(stage: int) -> list[tuple[int, int]]:
    """(buffer bytes, buffers lent) after each of 3 steps; stage 2 buckets hold an unused parameter."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny(n_layer=2, n_embd=32, vocab_size=64))
    unused = torch.nn.Parameter(torch.full((7,), 3.0))
    model.register_parameter("unused", unused)
    config = ZeroConfig(stage=stage, bucket_numel=5_000)
    optimizer = ZeroOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), dist.group.WORLD, config)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(dist.get_rank()))
    seen = []
    for _ in range(3):
        model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.step()
        seen.append((optimizer.reducer.buffer_bytes(), optimizer.reducer.pool.lent()))
    # Its slot in a reused staging buffer held another bucket's gradients: it must have been reduced as zeros.
    assert torch.equal(unused.detach(), torch.full((7,), 3.0)), unused
    return seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("stage", "native"), [(1, False), (2, True), (2, False)], ids=["1", "2-native", "2-gloo"])
def test_reduction_buffers_are_reused_across_steps_and_all_returned(stage, native):
    env = {NATIVE_COLLECTIVES_ENV: "1" if native else "0"}
    for seen in run_distributed(_reducer_buffers, 2, stage, env=env):
        sizes = {nbytes for nbytes, _ in seen}
        assert len(sizes) == 1, seen  # allocated in the first step, reused after
        if stage == 2 and not native:
            # Two gloo ranks: gradients are sent from .grad and received into the shard (Note [gradients sent from
            # where autograd put them]), nothing to pool. Stage 1 receives its in-place reduction into a buffer.
            assert sizes.pop() == 0, seen
        else:
            assert sizes.pop() > 0, seen
        assert all(lent == 0 for _, lent in seen), seen


def _stage3_buffers_after_backward() -> tuple[int, int]:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(GPTConfig.tiny(n_layer=2, n_embd=32, vocab_size=64))
    config = ZeroConfig(stage=3)
    gatherer = shard_module(model, config, dist.group.WORLD, torch.device("cpu"))
    optimizer = ZeroOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), dist.group.WORLD, config, gatherer)
    tokens = torch.randint(0, 64, (2, 9))
    peak = 0
    original_take = gatherer.reducer.pool.take

    def take(*args: object) -> torch.Tensor:
        nonlocal peak
        buffer = original_take(*args)  # type: ignore[arg-type]
        peak = max(peak, gatherer.reducer.buffer_bytes())
        return buffer

    gatherer.reducer.pool.take = take  # type: ignore[method-assign]
    model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    optimizer.step()
    return peak, gatherer.reducer.buffer_bytes()


@pytest.mark.timeout(60)
def test_stage3_frees_its_reduction_buffers_before_the_next_forward():
    # The native branch stages every bucket (gloo's two ranks pool nothing at all: Note [gradients sent from where
    # autograd put them]).
    for used, kept in run_distributed(_stage3_buffers_after_backward, 2, env={NATIVE_COLLECTIVES_ENV: "1"}):
        assert used > 0
        assert kept == 0  # Note [buffers between steps]
