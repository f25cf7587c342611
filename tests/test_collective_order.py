"""Every rank issues its collectives in one order, across communicators too (Note [one order of collectives] in
``comm/streams.py``): recorded at the calls into ``torch.distributed`` under
``LIGHTNING_ZERO_NATIVE_COLLECTIVES=1`` (NCCL's branch, on gloo), with ranks that route differently in a mixture of
experts, with prefetching and overlap on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import Tensor, nn

from lightning_zero import ZeroConfig, ZeroOptimizer, shard_module
from lightning_zero.comm.collectives import NATIVE_COLLECTIVES_ENV
from tests.boundary_models import VOCAB, WIDTH, MoEBlock
from tests.harness import run_distributed

Issue = tuple[str, str, int]
"""(function, group name, elements handed to it)."""

_RECORDED = (
    "all_gather_single",
    "all_gather_into_tensor",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_to_all_single",  # qgZ's hierarchical reduction
    "all_reduce",
)


class _RoutedLM(nn.Module):
    """Three blocks whose experts (a leaf, gathered with its block) are picked by the token ids."""

    def __init__(self, merged_expert: bool, reentrant: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(MoEBlock() for _ in range(3))
        self.extra = nn.ModuleList([nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)])
        self.merged_expert = merged_expert
        self.reentrant = reentrant
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: Tensor) -> Tensor:
        route = tokens * 4 // VOCAB
        x = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            if self.reentrant:  # each block's backward is a nested one: Note [final gradients]
                x = torch.utils.checkpoint.checkpoint(block, x, route, use_reentrant=True)
            else:
                x = block(x, route)
            # A unit only rank 0 runs (merged into the root in the first step: Note [data-dependent units]).
            if i == 0 and self.merged_expert and dist.get_rank() == 0:
                x = x + self.extra[0](x).tanh()
            if i == 1 and self.merged_expert:
                x = x + self.extra[1](x).tanh()
        logits: Tensor = self.head(x)
        return logits


def _recording(log: list[Issue], name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group")
        tensor = args[1] if len(args) > 1 else args[0]
        log.append((name, "world" if group is None else group.group_name, int(tensor.numel())))
        return function(*args, **kwargs)

    return call


def _issue_order(model_shape: str, config: dict[str, Any]) -> list[Issue]:
    log: list[Issue] = []
    for name in _RECORDED:
        if hasattr(dist, name):
            setattr(dist, name, _recording(log, name, getattr(dist, name)))
    torch.manual_seed(0)
    model = _RoutedLM(model_shape == "merged", model_shape == "reentrant")
    zero = ZeroConfig(stage=3, wrap_min_numel=0, **config)
    gatherer = shard_module(model, zero, dist.group.WORLD, torch.device("cpu"))
    optimizer = ZeroOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), dist.group.WORLD, zero, gatherer)
    rank = dist.get_rank()
    for step in range(3):
        # Rank 0's tokens reach every expert, rank 1's only expert 0 (rank 1's blocks get no gradient for the
        # other three): what a rank's gradients arrive for differs, and so did where its reductions were issued.
        g = torch.Generator().manual_seed(100 * rank + step)
        tokens = torch.randint(0, VOCAB if rank == 0 else VOCAB // 4, (2, 9), generator=g)
        logits = model(tokens[:, :-1])
        nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return log


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("model_shape", "config"),
    [
        ("plain", {}),
        ("merged", {}),
        ("plain", {"bucket_numel": 600, "max_inflight_buckets": 1}),
        ("plain", {"ranks_per_node": 2, "hpz_partition_size": 2, "quantize_gradients": True}),
        ("reentrant", {}),
    ],
    ids=["leaf_experts", "merged_unit_own_communicator", "small_buckets", "hpz_qgz", "reentrant_checkpoints"],
)
def test_every_rank_issues_gathers_and_reductions_in_one_order(model_shape: str, config: dict[str, Any]):
    orders = run_distributed(
        _issue_order, 2, model_shape, config, env={NATIVE_COLLECTIVES_ENV: "1"}, timeout=45, collective_timeout=15
    )
    kinds = {name for name, _, _ in orders[0]}
    assert "all_gather_single" in kinds, kinds
    assert kinds & {"reduce_scatter_single", "all_to_all_single"}, kinds
    if "hpz_partition_size" in config:  # backward gathers within the node, reductions over the node and across
        assert len({group for _, group, _ in orders[0]}) >= 3, set(orders[0])
    if model_shape == "merged":  # gathers went to a communicator of their own after the first forward
        assert len({(name[:3], group) for name, group, _ in orders[0]}) >= 3, set(orders[0])
    for position, (first, second) in enumerate(zip(*orders, strict=False)):
        assert first == second, f"collective {position}: rank 0 issued {first}, rank 1 {second}"
    assert len(orders[0]) == len(orders[1])
