"""``HostSteps``: when and on which thread the tiers' own bucket steps (``HostAdam``) run: exact or delayed.

Note [host step threads]
What runs where in a step of the buckets ``HostAdam`` covers. The training thread, per bucket: waits for the
gradient's copy to the host (issued in the backward, as the bucket's reduction completed), adopts edits where the
edit check found some, points the masters' ``.grad`` at the buffers the worker will fill, reads the
hyperparameters (``HostAdam.prepare``) and submits one task; then it publishes the previous bucket: waits for its
task, issues the upload of its staging buffer into the parameter shard, digests the shard (Note [edits reach the
masters]) and issues its all-gather. The worker's task for a bucket does every per-element pass of the bucket's
step, in order: the gradient's conversion to the masters' dtype (bf16 to fp32, into one buffer per worker reused
by every bucket it steps: ``HostTier.converted``), unscaling and clipping (``TieredGradients.set_on_masters``), the
update (torch's fused kernel), and the rounding of the updated masters into the staging buffer
(``HostTier.rounding``). So the update of bucket k and the passes around it overlap the training thread's publication
of bucket k-1 and loading of bucket k+1; on a GPU the copies are DMA on the copy streams and the training thread
only issues and orders them, and the clipping norm is taken on the device shards (``TieredGradients.norms``), so
no pass over host memory is left on the training thread. Each pass is the one the training thread ran before, on
the same elements, so the result is bit for bit the same. The update itself runs on torch's intra-op threads (the
fused kernel splits each tensor across them) by default; ``parallel="buckets"`` runs one worker per thread
instead, each stepping whole buckets on one intra-op thread (the same kernel per bucket: bit for bit the same
result), the buckets assigned in turn (``slot``), so each worker's buffers are its own. The two are measured
against each other in ``benchmarks/host_step.py`` (``tier``, ``tier_buckets``), the training thread's share in
``benchmarks/host_path.py`` (figures in ``benchmarks/README.md``). The workers take the intra-op thread count
``threads`` (by default that of the thread that built the tiers).

Note [delayed parameter update]
``ZeroConfig.offload_overlap="delayed"`` is ZeRO-Offload's one-step delayed parameter update: after
``offload_overlap_warmup`` exact steps (counted by the Lightning ``Trainer``'s ``global_step``, which every rank
shares and a checkpoint restores), the step returns as soon as the host updates are submitted: the host steps
step i's gradients while the device runs the forward and backward of step i + 1 with the weights it has, and the
new weights are published (uploaded, all-gathered) at the start of step i + 1's own step. So the gradient of step
i + 1 is computed on the weights before step i's update and applied after it: one step stale. While a step is in
flight nothing may read the host masters or moments: clipping (which reads the host gradients), an EMA of the
masters, ``state_dict()``, checkpoints and the end of training first wait for it, and all but clipping publish it
(``ZeroOptimizer.settle()``): a checkpoint holds the weights, masters and moments after every step taken so far,
and a run resumed from it continues exactly as the run that saved it (whose next step, like the resumed run's
first, starts a new update with nothing to publish).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal

import torch

from lightning_zero.sharding.state_tiers import TierStep


def chained(*parts: Callable[[], None] | None) -> Callable[[], None]:
    """One worker task running ``parts`` (None: skipped) one after the other."""
    steps = [p for p in parts if p is not None]

    def run() -> None:
        for step in steps:
            step()

    return run


class HostSteps:
    """Runs the tiers' own bucket updates on one worker thread; ``delayed_after``: the ``global_step`` from which
    updates are deferred (None: exact)."""

    def __init__(self, delayed_after: int | None = None, parallel: Literal["intra_op", "buckets"] = "intra_op") -> None:
        self.delayed_after = delayed_after
        self.step_number = 0
        """The Lightning ``Trainer``'s ``global_step`` at this step (set by the strategy before each step)."""
        self.parallel = parallel
        """How the host's threads share the updates (Note [host step threads]): ``"intra_op"``, one worker whose
        kernel splits each tensor across torch's intra-op threads; ``"buckets"``, one worker per thread, each
        stepping whole buckets on one intra-op thread. Read when the first update starts."""
        self.threads = torch.get_num_threads()
        """The host's threads for the updates (Note [host step threads]); read when the worker starts (``close()``
        stops it: the next update starts it again)."""
        self._lock = threading.Lock()
        self._pools: list[ThreadPoolExecutor] = []
        self._submitted = 0
        self._started: dict[int, Future[None]] = {}
        self._deferred: set[int] = set()
        self.busy_s = 0.0
        """Seconds the workers have spent in bucket tasks so far: the updates and the per-element passes around them
        (Note [host step threads]; the GPU check's split of a step)."""

    @property
    def workers(self) -> int:
        """Worker threads the updates are spread over (Note [host step threads])."""
        return self.threads if self.parallel == "buckets" else 1

    def slot(self) -> int:
        """The worker the next update ``start`` submits will run on: it has that worker's scratch buffers to itself
        (updates run one at a time on each worker, in the order they were started)."""
        return self._submitted % (len(self._pools) or self.workers)

    def _worker(self) -> ThreadPoolExecutor:
        if not self._pools:
            threads = 1 if self.parallel == "buckets" else self.threads
            self._pools = [
                ThreadPoolExecutor(1, f"host-step-{k}", initializer=lambda: torch.set_num_threads(threads))
                for k in range(self.workers)
            ]
        pool = self._pools[self.slot()]
        self._submitted += 1
        return pool

    @property
    def delays(self) -> bool:
        return self.delayed_after is not None and self.step_number >= self.delayed_after

    def start(self, key: int, update: Callable[[], None] | None) -> TierStep:
        """Run ``update`` (a bucket's, None: nothing to step) on the worker: started, or deferred past this step."""
        if update is not None:
            self._started[key] = self._worker().submit(self._timed, update)
        if self.delays:
            self._deferred.add(key)
            return TierStep.DEFERRED
        return TierStep.STARTED

    def _timed(self, update: Callable[[], None]) -> None:
        start = time.perf_counter()
        try:
            update()
        finally:
            with self._lock:  # several workers with parallel="buckets"
                self.busy_s += time.perf_counter() - start

    def finish(self, key: int) -> None:
        """The bucket's update has landed (its error, if any, is raised here, on the training thread)."""
        future = self._started.pop(key, None)
        self._deferred.discard(key)
        if future is not None:
            future.result()

    def join(self) -> None:
        """Every update started so far has landed (deferred ones stay to be published)."""
        for future in list(self._started.values()):
            future.result()

    def in_flight(self) -> set[int]:
        return set(self._deferred)

    def close(self) -> None:
        """Stop the worker after what it runs (an error there no longer matters: the run is over)."""
        for pool in self._pools:
            pool.shutdown(wait=True)
        self._pools = []
        self._submitted = 0
        self._started.clear()
        self._deferred.clear()
