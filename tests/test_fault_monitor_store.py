"""The fault monitor's own failures never reach training: Note [monitor must not hang shutdown]."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_zero.comm import fault_monitor
from lightning_zero.comm.fault_monitor import FaultMonitor


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
