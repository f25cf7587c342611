"""A rank that raises, is killed, or stops answering ends the whole job: every other rank exits on its own, non-zero,
within a bound, with an error that names the rank at fault (``lightning_zero/comm/fault_monitor.py``).

Each test runs ``tests/jobs/fault_job.py`` as real processes, one per rank, started the way torchrun starts them
(rank 0 hosts the c10d store), and times each survivor from the moment the fault is injected to its exit.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

JOB = Path(__file__).parent / "jobs" / "fault_job.py"
ROOT = Path(__file__).resolve().parent.parent
KILLS = ("kill-backward", "kill-reduce-scatter", "kill-all-gather")


@dataclass
class RankExit:
    returncode: int | None  # None: still running when the test stopped waiting (then killed)
    seconds_after_fault: float | None
    stderr: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_job(
    tmp: Path, fault: str, bound_s: float, world: int = 2, timeout_s: float = 1800.0, fault_rank: int = 1
) -> dict[int, RankExit]:
    """Start the job, inject ``fault`` on ``fault_rank``, wait up to ``bound_s`` after the fault for the others to
    exit.

    Whatever is still running then (the stopped or hanging rank itself, or a survivor that missed the bound) is
    SIGKILLed, as torchrun's agent would, and reported with ``returncode=None``.
    """
    port = _free_port()
    procs: dict[int, subprocess.Popen[bytes]] = {}
    logs = {}
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world)}
    base |= {"LOCAL_WORLD_SIZE": str(world), "NODE_RANK": "0", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    base["PYTHONPATH"] = os.pathsep.join([str(ROOT), base.get("PYTHONPATH", "")])
    command = [sys.executable, str(JOB), "--fault", fault, "--out", str(tmp), "--timeout", str(timeout_s)]
    command += ["--fault-rank", str(fault_rank)]
    exited: dict[int, tuple[int, float]] = {}
    try:
        for rank in range(world):
            logs[rank] = open(tmp / f"rank{rank}.stderr", "wb")  # noqa: SIM115  (closed in finally)
            env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            procs[rank] = subprocess.Popen(
                command, env=env, stdout=subprocess.DEVNULL, stderr=logs[rank], start_new_session=True
            )
        fault_file = tmp / "fault_time"
        deadline = time.monotonic() + 90  # start-up and a few steps
        while not fault_file.exists():
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs.values()):
                break
            time.sleep(0.1)
        time.sleep(0.2)  # the file is written just before the fault
        assert fault_file.exists(), "the fault was never injected:\n" + _stderr(tmp, 0) + _stderr(tmp, 1)
        fault_at = float(fault_file.read_text())
        stop_waiting = time.monotonic() + bound_s + 5  # beyond the bound, to measure a miss rather than hide it
        # A stopped or hanging rank never exits on its own: stop waiting once every other rank has.
        awaited = set(range(world)) if fault in ("raise", *KILLS) else set(range(world)) - {fault_rank}
        while not awaited <= exited.keys() and time.monotonic() < stop_waiting:
            for rank, p in procs.items():
                if rank not in exited and p.poll() is not None:
                    exited[rank] = (p.returncode, time.time() - fault_at)
            time.sleep(0.05)
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        for log in logs.values():
            log.close()
    return {rank: RankExit(*exited.get(rank, (None, None)), stderr=_stderr(tmp, rank)) for rank in range(world)}


def _stderr(tmp: Path, rank: int) -> str:
    path = tmp / f"rank{rank}.stderr"
    return f"\n--- rank {rank} stderr ---\n" + (path.read_text(errors="replace") if path.exists() else "")


def assert_exited_naming(exit: RankExit, bound_s: float, *named: str) -> None:
    assert exit.returncode is not None, f"still running {bound_s} s after the fault{exit.stderr}"
    assert exit.returncode != 0, exit.stderr
    assert exit.seconds_after_fault is not None
    assert exit.seconds_after_fault < bound_s, exit
    for text in named:
        assert text in exit.stderr, f"{text!r} not in{exit.stderr}"
    print(f"survivor exited {exit.returncode} after {exit.seconds_after_fault:.1f} s")


@pytest.mark.timeout(120)
def test_rank_raising_mid_training_ends_every_rank_and_is_named(tmp_path):
    exits = run_job(tmp_path, "raise", bound_s=60)
    assert_exited_naming(exits[0], 60, "Rank 1 failed first with ValueError: injected fault on rank 1")
    assert exits[1].returncode == 1, exits[1].stderr  # the failing rank itself exits with its error
    assert "ValueError: injected fault on rank 1" in exits[1].stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "fault",
    # 3-4 s each: the fault monitor sees the same dead process wherever it died; kill-all-gather runs by default.
    [pytest.param(fault, marks=pytest.mark.slow if fault != "kill-all-gather" else ()) for fault in KILLS],
)
def test_rank_killed_mid_step_ends_every_rank_and_is_named(tmp_path, fault):
    exits = run_job(tmp_path, fault, bound_s=60)
    assert exits[1].returncode == -signal.SIGKILL
    assert_exited_naming(exits[0], 60, "Rank 1 (pid", "died without reporting an error")


@pytest.mark.timeout(120)
def test_stopped_rank_fails_the_others_within_the_collective_timeout(tmp_path):
    exits = run_job(tmp_path, "stop", bound_s=10 + 30, timeout_s=10)
    assert exits[1].returncode is None  # frozen: only the launcher (here the test) can end it
    assert_exited_naming(exits[0], 10 + 30, "Rank 1 (pid", "is stopped")
    assert exits[0].seconds_after_fault is not None
    assert exits[0].seconds_after_fault >= 10 - 1  # it waited out the timeout, not sooner


@pytest.mark.slow  # 31 s: the store's host is stopped past the fault monitor's waits
@pytest.mark.timeout(150)
def test_stopped_store_host_fails_the_others_saying_the_store_does_not_answer(tmp_path):
    # Rank 0 hosts the c10d store here, as under Lightning's launcher: with it frozen, store calls block past their
    # timeout, and the diagnosis must still end (Note [monitor must not hang shutdown]).
    exits = run_job(tmp_path, "stop", bound_s=10 + 40, timeout_s=10, fault_rank=0)
    assert exits[0].returncode is None
    assert_exited_naming(exits[1], 10 + 40, "store at 127.0.0.1:", "does not answer", "look at rank 0")


@pytest.mark.slow  # 21 s: waits out the collective timeout (a stopped rank, the same wait, runs by default)
@pytest.mark.timeout(120)
def test_rank_stuck_in_a_loop_fails_the_others_within_the_collective_timeout(tmp_path):
    exits = run_job(tmp_path, "hang", bound_s=10 + 30, timeout_s=10)
    assert exits[1].returncode is None
    assert_exited_naming(exits[0], 10 + 30, "Rank 1 is alive", "never joined the collective")
