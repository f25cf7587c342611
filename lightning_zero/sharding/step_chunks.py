"""The step in chunks: the user's optimizer stepped one bucket at a time, each bucket's all-gather overlapping the next.

Note [step in chunks]
After the step every rank waits for the all-gather of the updated parameters, with nothing to compute meanwhile:
~50 ms of a 1.8 s step on the benchmark GPT (2 gloo ranks), a third of the step's own time. With ``overlap_comm``,
stages 1 and 2 therefore call the user's ``optimizer.step()`` once per bucket, each time with the param groups
narrowed to that bucket's masters, and issue the bucket's all-gather before stepping the next one; the step
returns once every gather is done, so nothing outside the step ever sees stale parameters. Element-wise optimizers
(everything sharding supports, see ``param_groups.check_elementwise``) compute the same update whether their
parameters come in one call or several: each parameter still takes exactly one step with its own state. Step hooks
still run once per step: Note [step hooks] in ``optimizer_hooks.py``.

Stage 3 steps in chunks too, for memory rather than overlap: torch's multi-tensor optimizers (the default on GPUs)
allocate temporaries as large as everything one call steps (Adam's ``_foreach_sqrt`` of the second moments: 4 bytes
per parameter of the shard, a quarter more than stage 3's 16 bytes per parameter). A 4.1B-parameter GPT at stage 3
on one H100 ran out of memory there (``scripts/gpu_check.sh``, 2026-11-26). One bucket at a time bounds them to a
bucket, as DeepSpeed's ``sub_group_size`` does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from lightning_zero.comm.collectives import ProcessGroup, all_gather
from lightning_zero.comm.ledger import CommLedger
from lightning_zero.sharding.flat_bucket import FlatBucket
from lightning_zero.sharding.param_edits import ParamEdits
from lightning_zero.sharding.param_groups import MasterRun, Segment, copy_masters_to_shards
from lightning_zero.sharding.state_tiers import StateTiers, TierStep

StepChunk = tuple[FlatBucket, list[int], list[Tensor], list[MasterRun]]
"""One bucket's segments' groups, masters and master runs."""


def build_step_chunks(
    buckets: list[FlatBucket], segments: list[Segment], masters: list[Tensor], runs: list[MasterRun]
) -> list[StepChunk]:
    """Each bucket's segments' groups, masters and master runs, in bucket order."""
    chunks: list[StepChunk] = []
    for bucket in buckets:
        chunk = [(seg, m) for seg, m in zip(segments, masters, strict=True) if seg.bucket is bucket]
        bucket_runs = [run for run in runs if run.bucket is bucket]
        chunks.append((bucket, [seg.group for seg, _ in chunk], [m for _, m in chunk], bucket_runs))
    return chunks


def step_in_chunks(
    optimizer: Optimizer,
    raw_step: Callable[[Optimizer], Any],
    chunks: list[StepChunk],
    tiers: StateTiers[Any] | None,
    ledger: CommLedger,
    group: ProcessGroup,
    edits: ParamEdits,
) -> None:
    """Step the shard bucket by bucket, all-gathering each bucket while the next is stepped (Note [step in
    chunks]). A bucket the tiers step themselves is published (its masters into the shard, its all-gather) once
    the next one has started, or, delayed, in the next step (Note [host step threads])."""
    groups = optimizer.param_groups
    everything = [g["params"] for g in groups]
    pending: list[Any] = []
    started: StepChunk | None = None
    try:
        if tiers is not None:
            publish_in_flight(chunks, tiers, ledger, group, edits, pending)
        for chunk in chunks:
            bucket, group_of, masters, runs = chunk
            if tiers is not None:
                tiers.load(bucket)
                edits.adopt(bucket, runs)  # Note [edits reach the masters]
                how = tiers.start_step(bucket)
                if how is not TierStep.GENERIC:
                    if started is not None:
                        _publish(started, tiers, ledger, group, edits, pending)
                    started = chunk if how is TierStep.STARTED else None
                    continue
            for g, param_group in enumerate(groups):
                param_group["params"] = [m for k, m in zip(group_of, masters, strict=True) if k == g]
            raw_step(optimizer)
            _publish(chunk, tiers, ledger, group, edits, pending)
        if started is not None:
            _publish(started, tiers, ledger, group, edits, pending)
    finally:
        for param_group, params in zip(groups, everything, strict=True):
            param_group["params"] = params
        for p in pending:
            p.wait()


def publish_in_flight(
    chunks: list[StepChunk],
    tiers: StateTiers[Any],
    ledger: CommLedger,
    group: ProcessGroup,
    edits: ParamEdits,
    pending: list[Any] | None = None,
) -> None:
    """Publish the buckets whose delayed step is still in flight (Note [delayed parameter update]), in bucket
    order on every rank; waits for their all-gathers unless ``pending`` collects them."""
    flying = tiers.in_flight()
    if not flying:
        return
    mine = [] if pending is None else pending
    for chunk in chunks:
        if id(chunk[0]) in flying:
            _publish(chunk, tiers, ledger, group, edits, mine)
    if pending is None:
        for p in mine:
            p.wait()


def _publish(
    chunk: StepChunk,
    tiers: StateTiers[Any] | None,
    ledger: CommLedger,
    group: ProcessGroup,
    edits: ParamEdits,
    pending: list[Any],
) -> None:
    """The bucket's step is done: masters into the parameter shard, back to the tiers, and its all-gather."""
    bucket, _, _, runs = chunk
    if tiers is not None:
        tiers.finish_step(bucket)
    copy_masters_to_shards(runs)
    if tiers is not None:
        tiers.unload(bucket)  # the host tier uploads its masters into the shard here
    edits.record(bucket)
    if bucket.resident:
        assert bucket.data is not None
        pending.append(ledger.record(all_gather(bucket.data, bucket.param_shard, group)))
