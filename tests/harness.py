"""Run a function on a local gloo process group, one process per rank, and collect the results.

Design notes (why, not what):

* Start method: ``forkserver`` with ``torch`` and ``lightning`` preloaded. The server imports them once;
  every rank is then a cheap ``fork()`` of that single-threaded, never-computed-anything server. Plain ``fork``
  of the pytest process is unsafe (torch thread pools and locks are already live there), and ``spawn`` re-imports
  torch in every rank. Measured on the 2-core CPU box (torch 2.13, lightning 2.6.6; start N processes that import
  torch + lightning and report back, steady state):

      spawn                                 N=2: 3.3 s   N=4: 7.1 s
      forkserver, no preload                N=2: 2.4 s   N=4: 5.4 s
      forkserver, preload torch             N=2: 1.4 s   N=4: 3.1 s
      forkserver, preload torch+lightning   N=2: 0.03 s  N=4: 0.04 s  (one-off ~2.6 s server start per session)

  Under pytest the server also preloads what nearly every rank of the suite imports later (``PRELOAD``, extended
  in ``tests/conftest.py``): ``lightning_zero`` itself, the modules Lightning imports lazily in every Trainer that
  saves a checkpoint (``omegaconf``, ``s3fs`` where installed), the Hugging Face and peft modeling stacks of the
  parity tests. Each is seconds per rank on a loaded machine, paid once per session instead.

  ``__main__`` is deliberately not preloaded, and ranks never re-run the pytest session (Lightning's own launcher
  re-executes the whole command line): multiprocessing at most imports the ``__main__``-guarded ``pytest`` script
  as ``__mp_main__`` (and nothing for ``python -m pytest``). Caveat: env vars read when torch is *imported* (e.g.
  OMP_NUM_THREADS) are frozen when the server starts; the rest of the caller's current environ reaches each rank.
  Ranks inherit the server's stdout/stderr, i.e. pytest's capture (shown on failure) or the terminal with ``-s``.
* Rendezvous: the parent hosts the TCPStore itself on port 0 and keeps it bound for the whole run, and ranks
  join it as clients (``TORCHELASTIC_USE_AGENT_STORE=True``, exactly like torchrun's agent store). This avoids
  the bind-close-rebind race of "find a free port" and works for both ``init_process_group`` modes; a FileStore
  would not give Lightning the MASTER_ADDR/MASTER_PORT it needs when it creates the group itself.
* Results come back over one pipe per rank (not a shared queue): a rank killed mid-write cannot corrupt or
  lock the channel of another rank, and a dead rank shows up as EOF on its own pipe.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Collection, Mapping
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

_GRACE_PERIOD = 2.0  # after the first failure, how long other ranks get to report their own error
_STACK_DUMP_WAIT = 0.5  # how long a rank gets to write its faulthandler stack dump before SIGKILL

__all__ = ["DistributedTestError", "run_distributed"]


class DistributedTestError(RuntimeError):
    """One or more ranks failed, died, or did not finish in time; ``failures`` maps rank -> description."""

    def __init__(self, headline: str, failures: Mapping[int, str]) -> None:
        self.failures = dict(failures)
        details = "".join(f"\n\n===== rank {r} =====\n{failures[r].rstrip()}" for r in sorted(failures))
        super().__init__(headline + details)


PRELOAD = ["torch", "lightning"]
"""What the forkserver imports once, before it forks any rank (a name not installed is skipped). The test suite adds
what nearly every one of its ranks imports (``tests/conftest.py``); a program using the harness alone (the GPU check)
keeps the server's start short. Changes take effect only before the server's first start."""


def _context() -> mp.context.ForkServerContext:
    ctx = mp.get_context("forkserver")
    # Only takes effect before the server's first start; harmless afterwards.
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _worker(
    rank: int,
    world_size: int,
    payload: bytes,
    environ: dict[str, str],
    sys_path: list[str],
    init_group: bool,
    collective_timeout: float,
    stack_file: str,
    conn: mpc.Connection,
) -> None:
    # If pytest is SIGKILLed, the forkserver exits and this kills us too: no orphans blocked in a collective.
    with contextlib.suppress(OSError, AttributeError):  # Linux-only; best effort elsewhere
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 == PR_SET_PDEATHSIG
    os.setpgrp()  # own process group, so the parent can also kill anything this rank forked
    with open(stack_file, "w") as stacks:  # the parent sends SIGUSR1 before killing: show where we hung
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
        # The forkserver's environ/sys.path are snapshots from when it started; use the caller's current ones.
        os.environ.clear()
        os.environ.update(environ)
        sys.path[:] = sys_path
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        message: tuple[bool, bytes | str]  # (True, pickled result) or (False, formatted traceback)
        try:
            fn, args = pickle.loads(payload)  # after sys.path is set, so fn's module can be imported
            if init_group:
                dist.init_process_group("gloo", timeout=timedelta(seconds=collective_timeout))
                # init_process_group no longer barriers by default (TORCH_DIST_INIT_BARRIER=0): without this, a
                # rank whose fn returns at once tears down its gloo pairs while a slower peer is still in
                # connectFullMesh, and that peer fails with "Connection closed by peer".
                dist.barrier()
            try:
                message = (True, pickle.dumps(fn(*args)))
            finally:
                if dist.is_available() and dist.is_initialized():  # also covers groups created by fn itself
                    dist.destroy_process_group()
        except BaseException:  # SystemExit/KeyboardInterrupt raised by fn are failures to report too
            message = (False, traceback.format_exc())
        finally:
            faulthandler.unregister(signal.SIGUSR1)  # the file is about to be closed
        conn.send(message)


def _describe_exit(proc: BaseProcess) -> str:
    proc.join(1.0)  # the sentinel/EOF can fire slightly before the exit code is known
    code = proc.exitcode
    if code is not None and code < 0:
        return f"died from signal {signal.Signals(-code).name} (exit code {code}) without reporting a result"
    return f"exited with code {code} without reporting a result"


def _signal(proc: BaseProcess, sig: signal.Signals, group: bool = False) -> None:
    if proc.pid is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone / no such group (yet)
            (os.killpg if group else os.kill)(proc.pid, sig)


def _shutdown(procs: Mapping[int, BaseProcess], doomed: Collection[int], stack_dir: str) -> dict[int, str]:
    """Reap every rank: SIGKILL the ``doomed`` ones at once (after a stack dump), give the others a moment to exit.

    Returns the stack dumps of the doomed ranks. Never leaves a process behind.
    """
    doomed = [r for r in doomed if r in procs and procs[r].is_alive()]
    for r in doomed:
        _signal(procs[r], signal.SIGUSR1)
    if doomed:
        time.sleep(_STACK_DUMP_WAIT)
    for r, p in procs.items():
        if r not in doomed:
            p.join(_GRACE_PERIOD)  # reported already: let it flush output and exit normally
        if p.is_alive():
            _signal(p, signal.SIGKILL, group=True)  # the group includes anything the rank forked
            p.kill()  # in case it had not called setpgrp() yet
        p.join()
    stacks = {}
    for r in doomed:
        try:
            with open(os.path.join(stack_dir, f"rank{r}.stacks")) as f:
                stacks[r] = f.read().strip()
        except FileNotFoundError:  # killed before it opened the file: its start outlasted the timeout
            stacks[r] = "(none: the rank had not started)"
    return stacks


def run_distributed(
    fn: Callable[..., T],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    collective_timeout: float = 30.0,
    init_process_group: bool = True,
    env: Mapping[str, str] | None = None,
    grace: float = _GRACE_PERIOD,
) -> list[T]:
    """Run fn(*args) on world_size gloo processes on localhost; return each rank's return value, in rank order.

    ``fn`` must be a module-level function; ``args`` and return values must be picklable. ``timeout`` bounds
    the whole group (wall clock, seconds); ``collective_timeout`` is the process group timeout and is unused when
    ``init_process_group=False`` (then code in ``fn``, e.g. a Lightning Trainer, creates the group from the
    MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/LOCAL_RANK/... env vars set here). Raises ``DistributedTestError``
    naming every failed, dead or hung rank with its traceback or stack dump. ``grace``: after the first failure,
    how long the other ranks get to report their own (a test that expects every rank to fail, each through its own
    slow path such as a teardown waiting for a process, gives them longer).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    deadline = time.monotonic() + timeout
    payload = pickle.dumps((fn, args))  # fail fast, in the caller, on anything unpicklable
    # Hosted here and referenced until we return, so the port stays ours for the whole run.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    base_env = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),  # never depend on hostname resolution
        **(env or {}),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "NODE_RANK": "0",
    }
    ctx = _context()
    procs: dict[int, BaseProcess] = {}
    conns: dict[int, mpc.Connection] = {}
    pending: list[int] = list(range(world_size))  # if anything below raises, every rank gets killed
    with tempfile.TemporaryDirectory(prefix="run_distributed_") as stack_dir:
        try:
            for rank in range(world_size):
                reader, writer = ctx.Pipe(duplex=False)
                rank_env = {**base_env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
                stack_file = os.path.join(stack_dir, f"rank{rank}.stacks")
                worker_args = (rank, world_size, payload, rank_env, sys.path, init_process_group)
                procs[rank] = ctx.Process(
                    target=_worker,
                    args=(*worker_args, collective_timeout, stack_file, writer),
                    name=f"{getattr(fn, '__name__', 'fn')}-rank{rank}",
                )
                procs[rank].start()
                writer.close()  # so the reader sees EOF once the rank is gone
                conns[rank] = reader
            results, failures, pending = _collect(procs, conns, deadline, grace)
        finally:
            stacks = _shutdown(procs, pending, stack_dir)
            for c in conns.values():
                c.close()
    if not failures and not pending:
        return [results[r] for r in range(world_size)]
    failed = ", ".join(str(r) for r in sorted(failures))
    reason = (
        f"still running {grace:g} s after rank(s) {failed} failed; killed"
        if failures
        else f"did not finish within timeout={timeout:g} s; killed"
    )
    for r in pending:
        failures[r] = f"{reason}. Stacks at kill time:\n{stacks.get(r) or '(none captured)'}"
    headline = f"{len(failures)} of {world_size} ranks failed: " + ", ".join(f"rank {r}" for r in sorted(failures))
    raise DistributedTestError(headline, failures)


def _collect(
    procs: Mapping[int, BaseProcess], conns: Mapping[int, mpc.Connection], deadline: float, grace: float
) -> tuple[dict[int, Any], dict[int, str], list[int]]:
    """Wait for every rank's report; return (results, failures in arrival order, ranks still running)."""
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    pending = set(procs)
    while pending and (now := time.monotonic()) < deadline:
        waitables: dict[Any, int] = {conns[r]: r for r in pending} | {procs[r].sentinel: r for r in pending}
        for obj in mpc.wait(list(waitables), timeout=deadline - now):
            rank = waitables[obj]
            if rank not in pending:
                continue  # both its pipe and its sentinel were ready
            pending.discard(rank)
            try:
                # poll(): a rank that forked before dying may leave its pipe open (no EOF) in a grandchild.
                if not conns[rank].poll():
                    raise EOFError
                ok, data = conns[rank].recv()
            except (EOFError, OSError):  # died before/while reporting: segfault, SIGKILL, os._exit, OOM...
                failures[rank] = _describe_exit(procs[rank])
                continue
            if not ok:
                failures[rank] = data
                continue
            try:
                results[rank] = pickle.loads(data)
            except Exception:
                failures[rank] = "return value could not be unpickled in the parent:\n" + traceback.format_exc()
        if failures:
            # Others may be stuck in a collective with the failed rank: give them a moment to fail on their own.
            deadline = min(deadline, time.monotonic() + grace)
    return results, failures, sorted(pending)


def fresh_rendezvous_port() -> None:
    """Forget the port an earlier launch of Lightning's multiprocessing launcher left in this process's
    ``MASTER_PORT`` (it writes the port it picked there, and the next launch would reuse it while the last group's
    store may still hold it: EADDRINUSE); the next launch picks a free one."""
    os.environ.pop("MASTER_PORT", None)
