"""``OneRankCalls``: a stage-3 model called outside a step, on every rank or on one rank while the others wait.

Note [one-rank calls]
A stage-3 call gathers parameters from every rank, so a forward, ``state_dict()`` or ``gathered_parameters()`` made by
one rank alone (LitGPT samples on rank 0 while the others wait in ``fabric.barrier()``; ``if rank == 0:
model.state_dict()``) would block in its first all-gather until the collective timeout. DDP needs no peer for a
forward without gradients; FSDP2 hangs there too. Here such a call either works or fails within seconds, naming the
ranks and the fix, and the training step is untouched:

- *Calls.* A call made outside a step (a forward without gradients outside a Lightning step, ``state_dict()``,
  ``gathered_parameters()``) first meets the other ranks in the c10d store: it adds itself to the epoch's call counter
  and waits until every rank has made the same call (the counter reaches ``world * (k + 1)`` for the k-th call of
  the epoch), and then gathers as usual, collectively. Steps (training, validation, the strategy's own checkpoint
  IO) and forwards with gradients never touch the store: they are collective by contract, as under DDP.
- *Serving points.* The strategy's ``barrier()`` first counts the rank in the store as waiting, then polls it until
  every rank is there, serving in the meantime the requests of a rank that calls the model alone; only then does the
  real barrier run. Only the barrier: Lightning's and users' loops call ``broadcast`` and ``all_reduce`` inside
  training steps (Lightning's ``Timer`` broadcasts after every batch), which must not touch the store, and a barrier
  is where a rank waits for another on purpose. An *epoch* is the time between two serving points:
  every rank passes the same serving points in the same order, so epochs agree.
- *Served calls.* A rank whose call finds every other rank waiting at this epoch's serving point serves itself the
  rest of the epoch (the others cannot leave before it arrives): before each collective of its calls it posts
  ``(kind, index)`` (a unit's exact gather, a bucket of a state dict) in the store, and each waiting rank runs the
  same collective for ``index`` (``handlers[kind]``), discarding the result. So the call runs at one unit's memory on
  every rank, with exact (never qwZ-quantized) weights, no prefetch and no rank-divergence exchange.
- *Failing fast.* A call that finds neither within ``min(collective_timeout_s, 30)`` seconds, or learns that a rank
  has ended, fails naming the missing ranks and the fix, and marks the epoch abandoned so that the ranks serving it
  fail too instead of waiting out the collective timeout.

Cost: nothing in a training step; one store round trip per call outside a step (a validation forward under Fabric,
which cannot tell its validation from its sampling) and a few per serving point. A model with no trainable parameter
(a frozen teacher, whose forwards without gradients run inside every training step of a distillation loop) is not
met in the store: its calls are collective, as under DDP.
"""

from __future__ import annotations

import atexit
import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch.distributed as dist

from lightning_zero.compat import PrefixStore, Store

__all__ = ["OneRankCallError", "OneRankCalls", "serving"]

_MAX_POLL_S = 0.02
_CLOSE_POLL_S = 0.001


class OneRankCallError(RuntimeError):
    """A call outside a step that the other ranks neither made nor waited for (Note [one-rank calls])."""


class OneRankCalls:
    """The store protocol of Note [one-rank calls] for one sharded model's process group."""

    def __init__(self, store: Store, group: dist.ProcessGroup, collective_timeout_s: float) -> None:
        self.rank = group.rank()
        self.world = group.size()
        # One key space per sharded model: every rank makes its models' instances in the same order, each before
        # sharding's first collective, so the n-th instance of every rank gets the same number.
        instance = (PrefixStore("lightning_zero/calls/", store).add("instances", 1) - 1) // self.world
        self.store = PrefixStore(f"lightning_zero/calls/{instance}/", store)
        self.collective_timeout_s = collective_timeout_s
        """How long a serving point waits for every rank, as the collective it stands before would."""
        self.timeout_s = min(collective_timeout_s, 30.0)
        """How long a call waits for the other ranks to make it or to wait for it (Note [one-rank calls])."""
        self.handlers: dict[str, Callable[[int], object]] = {}
        """What a serving rank runs for a request ``(kind, index)``, mirroring the caller's collective."""
        self.epoch = 0
        self._calls = 0  # calls begun in this epoch
        self._depth = 0  # nesting of the current call
        self._steps = 0  # nesting of step() contexts
        self._requests = 0  # requests posted (served) or served (waiting) in this epoch
        self._deadline = 0.0  # when a serving point stops waiting
        self.served = False
        """This rank calls alone for the rest of the epoch, served by the waiting ranks."""
        atexit.register(self.close)

    # -- the calling side -------------------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """Inside a call or a step: collectives go ahead without meeting the other ranks first."""
        return self._depth > 0 or self._steps > 0

    @contextmanager
    def step(self) -> Iterator[None]:
        """A region every rank runs together (a Lightning step, a checkpoint IO): no store traffic."""
        self._steps += 1
        try:
            yield
        finally:
            self._steps -= 1

    def begin(self, what: str) -> None:
        """Start a call outside a step (nested calls just count); collective or served once this returns."""
        if self.active or self.served or self.world == 1:
            self._depth += 1
            return
        k, key = self._calls, f"{self.epoch}/calls"
        arrived = self.store.add(key, 1)
        self._calls += 1
        self._depth = 1
        if arrived == self.world * (k + 1):  # the last rank to arrive: everyone makes this call
            self.store.set(f"{self.epoch}/go/{k}", "1")
            if k > 0:
                self.store.delete_key(f"{self.epoch}/go/{k - 1}")  # every rank is past it
            return
        deadline, poll = time.monotonic() + self.timeout_s, 0.0001
        first_poll_until = time.monotonic() + 0.1
        while not self.store.check([f"{self.epoch}/go/{k}"]):  # (a store's wait() with a timeout logs each expiry)
            waiting = self.store.add(f"{self.epoch}/wait", 0)
            here = self.store.add(key, 0) - self.world * k
            if waiting and here + waiting == self.world:  # every other rank waits at the serving point instead
                if here == 1:
                    self.served = True
                    return
                self._fail(what, f"{here} ranks made it alone while the others wait")
            if self.store.add("ended", 0):
                self._fail(what, "a rank has ended its run")
            if time.monotonic() > deadline:
                self._fail(what, f"they did not arrive within {self.timeout_s:g} s")
            time.sleep(poll)
            # Ranks making the same call arrive within a few milliseconds: poll closely at first, then back off.
            poll = min(poll * 2, _MAX_POLL_S if time.monotonic() > first_poll_until else _CLOSE_POLL_S)

    def end(self) -> None:
        self._depth -= 1

    def collective(self, kind: str, index: int) -> None:
        """A served caller's next collective is ``handlers[kind](index)`` on the waiting ranks: ask them for it."""
        if self.served:
            self.store.set(f"{self.epoch}/req/{self._requests}", f"{kind}:{index}")
            self._requests += 1

    def _fail(self, what: str, why: str) -> None:
        self._depth = 0
        message = (
            f"Rank {self.rank} called the stage-3 model ({what}) outside a training step, and the other ranks neither "
            f"made the same call nor waited for it in the strategy's barrier(): {why}. A stage-3 call gathers "
            "parameters from every rank. HINT: make the call on every rank, or have the other ranks wait for it in "
            "`fabric.barrier()` / `trainer.strategy.barrier()` (as LitGPT follows its sampling on rank 0 with "
            "`fabric.barrier()`)."
        )
        self.store.set(f"{self.epoch}/abandoned", message)
        raise OneRankCallError(message)

    # -- the waiting side (``serving``) ---------------------------------------------------------------------------
    def _arrive(self) -> None:
        self.store.add(f"{self.epoch}/wait", 1)
        self._deadline = time.monotonic() + self.collective_timeout_s

    def _serve_one(self) -> bool:
        """Serve the next request of a lone caller, if one is posted."""
        request = f"{self.epoch}/req/{self._requests}"
        if not self.store.check([request]):
            return False
        kind, index = self.store.get(request).decode().split(":")
        self.handlers[kind](int(index))
        self._requests += 1
        return True

    def _everyone_here(self) -> bool:
        if self.store.add(f"{self.epoch}/wait", 0) == self.world:
            return True
        if self.store.check([f"{self.epoch}/abandoned"]):
            raise OneRankCallError(self.store.get(f"{self.epoch}/abandoned").decode())
        ended = self.store.add("ended", 0)
        if ended or time.monotonic() > self._deadline:
            missing = self.world - self.store.add(f"{self.epoch}/wait", 0)
            why = "ended their run" if ended else f"did not arrive in {self.collective_timeout_s:g} s"
            raise OneRankCallError(
                f"Rank {self.rank} waited in the strategy's barrier for {missing} rank(s) that {why}. HINT: every "
                "rank must reach the same barriers."
            )
        return False

    def _leave(self) -> None:
        epoch, requests, calls = self.epoch, self._requests, self._calls
        self.epoch += 1
        self._calls = self._requests = 0
        self.served = False
        if self.rank == 0:  # every rank has left the epoch's serving loop: the collective after it completed
            keys = [f"{epoch}/calls", f"{epoch}/wait"] + [f"{epoch}/req/{i}" for i in range(requests)]
            for key in keys + ([f"{epoch}/go/{calls - 1}"] if calls else []):
                self.store.delete_key(key)

    def close(self) -> None:
        """This rank's run has ended: a call waiting for it fails at once."""
        atexit.unregister(self.close)
        with contextlib.suppress(Exception):  # the store's host may be gone already at exit
            self.store.add("ended", 1)


@contextmanager
def serving(every: Sequence[OneRankCalls]) -> Iterator[None]:
    """A serving point of the sharded models ``every`` (Note [one-rank calls]): count this rank as waiting, serve a
    lone caller's requests of any of them until every rank is there, then run the body (the real collective) and
    start the next epoch."""
    waiting = [calls for calls in every if calls.world > 1 and not calls.active]
    if not waiting:
        yield
        return
    for calls in waiting:
        calls._arrive()
    poll = 0.001
    while True:
        if any(calls._serve_one() for calls in waiting):
            poll = 0.001
            continue
        if all(calls._everyone_here() for calls in waiting):
            break
        time.sleep(poll)
        poll = min(poll * 2, _MAX_POLL_S)
    try:
        yield
    finally:
        for calls in waiting:
            calls._leave()
