"""Where each byte of model state sits on one rank, laid out by the strategy's own code on a meta-device model.

``layout_estimates`` lays a model out as rank 0 of N for every stage: ``build_buckets`` over the optimizer's param
groups (stages 1 and 2, as ``ZeroOptimizer``), the unit policy ``find_unit_roots`` / ``assign_parameters`` and
``unit_bucket_layout`` (stage 3, as ``shard_module``), and ``segments_of`` for master weights and optimizer state
(Note [estimate for rank 0] in ``cli/estimate.py``). ``paper_estimates`` is the ZeRO paper's formula for the same
quantities. ``python -m lightning_zero estimate`` prints both; ``peak`` adds a step's transient memory to them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

from torch import nn
from torch.optim import Optimizer

from lightning_zero.config import ZeroConfig
from lightning_zero.planning.model_state import ModelStateBytes, expected_model_state_bytes
from lightning_zero.sharding.flat_bucket import FlatBucket, build_buckets
from lightning_zero.sharding.param_groups import segments_of, trainable_named_groups
from lightning_zero.stage3.sharded_init import unit_bucket_layout
from lightning_zero.stage3.wrap_policy import assign_parameters, find_unit_roots

# The collectives of one optimizer step, and the paper's elements each rank sends in them.
ALL_REDUCE = "all-reduce of the gradients"
REDUCE_SCATTER = "reduce-scatter of the gradients"
GATHER_AFTER_STEP = "all-gather of the parameters after the step"
GATHER_FORWARD = "all-gather of each unit before its forward"
GATHER_BACKWARD = "all-gather of each unit before its backward"
GATHER_PERSISTENT = "all-gather of the persistent parameters after the step"

Precision = Literal["bf16", "fp16", "fp32"]
PARAM_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4}
RANK = 0  # Note [estimate for rank 0] in cli/estimate.py

# The collectives of each stage's optimizer step, in the order the traffic table lists them.
STAGE_COLLECTIVES = {
    0: (ALL_REDUCE,),
    1: (REDUCE_SCATTER, GATHER_AFTER_STEP),
    2: (REDUCE_SCATTER, GATHER_AFTER_STEP),
    3: (GATHER_FORWARD, GATHER_BACKWARD, REDUCE_SCATTER),
}


class Precisions(NamedTuple):
    """Bytes per parameter element of each kind of model state."""

    param: int
    """Parameters, and gradients (same dtype)."""
    master: int
    """fp32 master copy: 4 with 16-bit parameters, 0 with fp32 ones (they are their own master)."""
    optimizer: int
    """Optimizer state besides the master copy (Adam: 8). ``master + optimizer`` is the paper's K."""

    @classmethod
    def of(cls, precision: Precision, k: int | None) -> Precisions:
        param = PARAM_BYTES[precision]
        master = 4 if param < 4 else 0
        k = master + 8 if k is None else k
        if k < master:
            raise ValueError(
                f"Invalid K: {k!r} bytes per parameter is less than the {master}-byte fp32 master copy that "
                f"{precision} parameters need. HINT: K counts master weights and optimizer state (12 for Adam)."
            )
        return cls(param, master, k - master)

    @property
    def k(self) -> int:
        return self.master + self.optimizer


class Traffic(NamedTuple):
    """One collective of a step and the bytes this rank sends in it, counted as ``comm.collectives`` counts them."""

    collective: str
    sent: int
    formula: int
    """The paper's bytes for the same collective (0 where the paper has none)."""


class BucketSize(NamedTuple):
    """One flat bucket as the strategy lays it out: which parameters, how many elements in full and per shard."""

    params: tuple[str, ...]
    """The names of its parameters, as ``state_dict()`` gives them."""
    padded_numel: int
    shard_numel: int
    trainable: bool
    """Whether it gets gradients (every parameter of a bucket shares ``requires_grad``)."""
    stepped: bool
    """Whether the optimizer steps it (it holds parameters of a param group): it has masters and optimizer state."""


class UnitSize(NamedTuple):
    """A stage-3 gather unit and the elements gathered on every rank while it is in use, padding included."""

    name: str
    numel: int
    buckets: tuple[BucketSize, ...] = ()
    """Its sharded buckets; persistent parameters (``persistence_threshold``) are in none."""


class StageEstimate(NamedTuple):
    """One stage's numbers for one rank."""

    stage: int
    """0 for DDP."""
    state: ModelStateBytes
    """Bytes this rank holds (the strategy's layout in ``--model`` mode, the formula otherwise)."""
    formula: ModelStateBytes
    """The ZeRO paper's formula for the same model and N."""
    traffic: tuple[Traffic, ...]
    """Bytes this rank sends per optimizer step, by collective."""
    buckets: int
    """Flat buckets the parameters are packed into; 0 for the formula."""
    padding: int
    """Elements of padding in the full flat buffers (each bucket is padded to a multiple of N, < N elements)."""
    units: tuple[UnitSize, ...] = ()
    """Stage 3 in ``--model`` mode: every gather unit, the root unit first."""
    bucket_sizes: tuple[BucketSize, ...] = ()
    """Stages 1 and 2 in ``--model`` mode: the buckets in launch order (Note [bucket order]); stage 3: the
    persistent buckets."""

    @property
    def sent(self) -> int:
        return sum(t.sent for t in self.traffic)

    @property
    def largest_unit(self) -> UnitSize | None:
        """The unit whose full parameters one rank gathers at once: stage 3's transient peak of parameter memory."""
        return max(self.units, key=lambda u: u.numel, default=None)


# -- the formula -------------------------------------------------------------------------------------------------------
def _formula(num_params: int, world_size: int, stage: int, p: Precisions) -> ModelStateBytes:
    return expected_model_state_bytes(num_params, world_size, stage, p.param, p.master, p.optimizer)


def _paper_traffic(num_params: int, world_size: int, stage: int, param_bytes: int) -> tuple[Traffic, ...]:
    one_way = num_params * param_bytes * (world_size - 1) // world_size  # a ring's Ψ(N-1)/N
    sizes = {ALL_REDUCE: 2 * one_way}
    return tuple(Traffic(c, sizes.get(c, one_way), sizes.get(c, one_way)) for c in STAGE_COLLECTIVES[stage])


def paper_estimates(num_params: int, world_size: int, precisions: Precisions) -> list[StageEstimate]:
    """Every stage by the ZeRO paper's formula: model state and bytes sent per step by each rank."""
    out = []
    for stage in STAGE_COLLECTIVES:
        formula = _formula(num_params, world_size, stage, precisions)
        traffic = _paper_traffic(num_params, world_size, stage, precisions.param)
        out.append(StageEstimate(stage, formula, formula, traffic, 0, 0))
    return out


# -- the strategy's own layout -----------------------------------------------------------------------------------------
def _sizes(bucket: FlatBucket, group_of: dict[int, int]) -> BucketSize:
    stepped = bucket.trainable and any(id(t) in group_of for t in bucket.params)
    names = tuple(slot.fqn for slot in bucket.slots)
    return BucketSize(names, bucket.padded_numel, bucket.shard_numel, bucket.trainable, stepped)


def _master_numel(buckets: Sequence[FlatBucket], group_of: dict[int, int]) -> int:
    """Elements of this rank's shards that get a master weight and optimizer state, as ``ZeroOptimizer`` cuts them."""
    return sum(seg.stop - seg.start for b in buckets for seg in segments_of(b, group_of))


def _ring(buckets: Sequence[FlatBucket], param_bytes: int) -> int:
    """Bytes one rank sends to all-gather, or reduce-scatter, these buckets: its shard to each of N-1 others."""
    return sum(b.shard_numel * (b.world_size - 1) for b in buckets) * param_bytes


def _traffic(stage: int, sent: dict[str, int], num_params: int, world_size: int, p: Precisions) -> tuple[Traffic, ...]:
    paper = {t.collective: t.formula for t in _paper_traffic(num_params, world_size, stage, p.param)}
    return tuple(Traffic(c, nbytes, paper.get(c, 0)) for c, nbytes in sent.items() if nbytes or c in paper)


def layout_estimates(
    module: nn.Module, optimizer: Optimizer, world_size: int, precisions: Precisions, config: ZeroConfig
) -> list[StageEstimate]:
    """Every stage as the strategy lays ``module`` out on rank 0 of ``world_size`` (Note [estimate for rank 0]).

    ``module`` should be on the meta device, and is used up: laying it out makes its parameters views into flat
    buffers (without storage on meta). ``optimizer`` is the one ``configure_optimizers`` returns for it; ``config``
    supplies ``bucket_numel`` and the stage-3 unit policy.
    """
    n, p = world_size, precisions
    named_groups = trainable_named_groups(module, optimizer)
    group_of = {id(t): g for g, named in enumerate(named_groups) for _, t in named}
    num_params = sum(t.numel() for t in module.parameters())
    ddp = _formula(num_params, n, 0, p)  # DDP has no layout of its own: the formula is exact
    out = [StageEstimate(0, ddp, ddp, _paper_traffic(num_params, n, 0, p.param), 0, 0)]

    # Stages 1 and 2: ZeroOptimizer's buckets. Parameters are views into the full padded buffers (those outside the
    # optimizer stay as they are); stage 1 keeps full padded gradients, stage 2 only its shard.
    buckets = build_buckets(named_groups, config.bucket_numel, RANK, n, list(module.parameters()))
    padded = sum(b.padded_numel for b in buckets)
    outside = sum(t.numel() for t in module.parameters() if id(t) not in group_of)
    masters = _master_numel(buckets, group_of)
    stage1 = ModelStateBytes((padded + outside) * p.param, padded * p.param, masters * p.master, masters * p.optimizer)
    stage2 = stage1._replace(gradients=sum(b.shard_numel for b in buckets) * p.param)
    sent = {REDUCE_SCATTER: _ring(buckets, p.param), GATHER_AFTER_STEP: _ring(buckets, p.param)}
    padding = sum(b.padded_numel - b.numel for b in buckets)
    for stage, state in ((1, stage1), (2, stage2)):
        traffic = _traffic(stage, sent, num_params, n, p)
        sizes = tuple(_sizes(b, group_of) for b in buckets)
        out.append(
            StageEstimate(stage, state, _formula(num_params, n, stage, p), traffic, len(buckets), padding, (), sizes)
        )
    out.append(_stage3(module, group_of, num_params, n, p, config))
    return out


def _stage3(
    module: nn.Module, group_of: dict[int, int], num_params: int, n: int, p: Precisions, config: ZeroConfig
) -> StageEstimate:
    """``shard_module``'s units and their buckets. On meta a resident bucket keeps its full buffer for free, so every
    bucket is built resident and only its sizes are read."""
    unit_roots = find_unit_roots(module, config)
    units: list[UnitSize] = []
    sharded: list[FlatBucket] = []
    persistent: list[FlatBucket] = []
    names = ["<root>", *(name for name, _ in unit_roots)]
    for name, named in zip(names, assign_parameters(module, unit_roots), strict=True):
        mine: list[FlatBucket] = []
        for resident, members in unit_bucket_layout(named, config):
            (persistent if resident else mine).append(FlatBucket(-1, -1, members, RANK, n))
        sharded += mine
        units.append(UnitSize(name, sum(b.padded_numel for b in mine), tuple(_sizes(b, group_of) for b in mine)))
    trainable = [b for b in sharded + persistent if b.trainable]  # the gradient reducer's buckets
    stepped = [b for b in trainable if any(id(t) in group_of for t in b.params)]  # the optimizer's
    masters = _master_numel(stepped, group_of)
    params = sum(b.shard_numel for b in sharded) + sum(b.padded_numel for b in persistent)
    grads = sum(b.shard_numel for b in trainable)
    state = ModelStateBytes(params * p.param, grads * p.param, masters * p.master, masters * p.optimizer)
    sent = {GATHER_FORWARD: _ring(sharded, p.param), GATHER_BACKWARD: _ring(sharded, p.param)}
    sent[REDUCE_SCATTER] = _ring(trainable, p.param)
    sent[GATHER_PERSISTENT] = _ring([b for b in stepped if any(b is q for q in persistent)], p.param)
    every = sharded + persistent
    padding = sum(b.padded_numel - b.numel for b in every)
    traffic = _traffic(3, sent, num_params, n, p)
    kept = tuple(_sizes(b, group_of) for b in persistent)
    return StageEstimate(3, state, _formula(num_params, n, 3, p), traffic, len(every), padding, tuple(units), kept)
