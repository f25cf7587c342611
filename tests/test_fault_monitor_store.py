"""The fault monitor's own failures never reach training: Note [monitor must not hang shutdown]."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_zero.comm import fault_monitor
from lightning_zero.comm.fault_monitor import FaultMonitor


@pytest.mark.slow  # 9 s of connection retries
@pytest.mark.timeout(60)
def test_a_monitor_that_cannot_reach_the_store_is_left_out_with_a_warning(caplog):
    # A rank whose monitor clients cannot connect must go on training, not fail its setup while its peers wait in
    # their first collective (Note [monitor must not hang shutdown]).
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    client = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", server.port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=1)
    )
    address = f"127.0.0.1:{server.port}"
    del server  # nothing listens on the port any more
    with caplog.at_level(logging.WARNING, logger=fault_monitor.__name__):
        monitor = FaultMonitor.connect(client, rank=1, world_size=2, connect_timeout_s=1.0)
    assert monitor is None
    warning = "\n".join(r.getMessage() for r in caplog.records)
    assert "Rank 1 runs without a fault monitor" in warning, warning
    assert address in warning, warning
    assert "Training is not affected" in warning


@pytest.mark.timeout(60)
def test_a_diagnosis_ends_in_bounded_time_when_the_stores_host_is_stopped():
    # A stopped (not dead) store host leaves store calls blocked past the clients' timeout; the diagnosis must still
    # return, naming the store, so the failing rank's error reaches the user instead of hanging in on_exception.
    host = subprocess.Popen(
        [sys.executable, "-c", _STORE_HOST],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(host.stdout.readline())  # type: ignore[union-attr]
        client = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)  # type: ignore[attr-defined]
        monitor = FaultMonitor(client, rank=1, world_size=2, interval_s=0.2, store_timeout_s=0.5)
        os.kill(host.pid, signal.SIGSTOP)
        start = time.monotonic()
        note = monitor.diagnose()
        elapsed = time.monotonic() - start
    finally:
        host.kill()
        host.wait()
    assert f"store at 127.0.0.1:{port} does not answer" in note, note
    assert elapsed < monitor._diagnosis_budget_s() + 2.0, elapsed


_STORE_HOST = """
import time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
print(store.port, flush=True)
time.sleep(120)
"""
