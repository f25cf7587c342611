"""The fault monitor's store traffic at 1024 ranks (Note [store traffic at scale]): one rank's diagnosis costs a
bounded number of store requests, whatever the world size, and still names the rank at fault."""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import pytest
import torch.distributed as dist

from lightning_zero.comm import fault_monitor
from lightning_zero.comm.fault_monitor import FaultMonitor

WORLD = 1024


class CountingStore:
    """Forwards to a store and counts the requests (the monitor only uses these methods)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.requests: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        def counted(*args: Any) -> Any:
            self.requests[name] += 1
            return method(*args)

        return counted


def _monitor(store: dist.Store, rank: int) -> FaultMonitor:
    monitor = FaultMonitor(store, rank, WORLD, interval_s=0.05, store_timeout_s=1.0)
    monitor._store = CountingStore(monitor._store)  # type: ignore[assignment]
    return monitor


@pytest.mark.timeout(60)
@pytest.mark.parametrize("origin", [False, True], ids=["hung-rank", "raising-rank"])
def test_a_diagnosis_at_1024_ranks_reads_a_bounded_number_of_keys(origin, monkeypatch):
    monkeypatch.setattr(fault_monitor, "_starts", itertools.repeat(0))  # 1024 "processes" sharing one namespace
    store = dist.HashStore()
    peer = FaultMonitor(store, 0, WORLD)  # writes the keys of every other rank in turn (no thread started)
    culprit = 700
    for rank in range(WORLD):
        peer.rank = rank
        peer._store.set(f"heartbeat/{rank}", "7")  # every rank has beaten once, then froze
        if origin and rank == culprit:
            peer.publish(ValueError("bad batch"))
        elif rank >= 2 and rank != culprit:  # every rank but 0, 1 and the culprit reported its collective failure
            peer.publish(RuntimeError("gloo: Connection closed by peer"))
    me = _monitor(store, 0)
    error = RuntimeError("gloo: Timed out waiting 1000ms for recv")
    me.on_exception(error)
    note = error.__notes__[0]
    requests = sum(me._store.requests.values())
    if origin:
        assert "Rank 700 failed first with ValueError: bad batch" in note, note
    else:
        assert "Rank 1 stopped answering" in note, note  # rank 1 never reported: a suspect too
        assert "Rank 700 stopped answering" in note, note
    # Polls every 0.25 s (here every 0.05 s) for ~3 heartbeat intervals plus a handful of reads: not ~N per rank.
    assert requests < 120, me._store.requests
