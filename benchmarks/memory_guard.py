"""Run a job on a shared machine without letting it exhaust the machine's memory.

    python benchmarks/memory_guard.py --budget-gb 20 --margin-gib 1.5 -- torchrun --nproc-per-node 2 job.py

The job (a command and every process it starts, wherever they put themselves: its process tree) is watched from
this process, which allocates nothing while it waits: every ``poll`` seconds it reads the machine's ``MemAvailable``
(``/proc/meminfo``) and the resident set of each process of the tree (``/proc/<pid>/statm``). The job is stopped
(``SIGKILL`` to every process of the tree, so no rank is left waiting on a collective) as soon as

* the tree's RSS, summed over its processes, exceeds ``budget`` (the job does not fit the budget), or
* ``MemAvailable`` falls below ``margin`` (the machine is about to run out, whoever is using it: the kernel's OOM
  killer would otherwise pick a victim, possibly another engineer's process).

The two are told apart in the result: only the first says anything about the job. Before starting, ``wait_for_memory``
waits until the machine has the memory the job may need, so a run does not start while another one is filling it.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

GB = 1e9
GIB = 1 << 30
_PAGE = os.sysconf("SC_PAGE_SIZE")
_PR_SET_CHILD_SUBREAPER = 36  # prctl option, <linux/prctl.h>


def mem_available() -> int:
    """The kernel's estimate of the bytes that can be allocated without swapping (``MemAvailable``)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable line: this guard needs Linux 3.14 or newer")


def _processes() -> dict[int, tuple[int, int]]:
    """(parent pid, resident bytes) of every live process, by pid."""
    table: dict[int, tuple[int, int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
            # Fields after the command name (which may contain spaces and parentheses): state, ppid, ...
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            table[int(entry.name)] = (ppid, int(Path(entry.path, "statm").read_text().split()[1]) * _PAGE)
        except (OSError, ValueError):
            continue  # the process ended while being read
    return table


def tree_rss(root: int) -> dict[int, int]:
    """Resident bytes of ``root`` and every live descendant, by pid. Launchers may put their workers in sessions
    of their own (torchrun does), so the job is its process tree, not its process group; this process is made a
    child subreaper (``run_guarded``), so a worker whose launcher died is re-parented here and stays in the tree."""
    table = _processes()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    tree, todo = {}, [root] if root in table else []
    while todo:
        pid = todo.pop()
        tree[pid] = table[pid][1]
        todo.extend(children.get(pid, []))
    return tree


def _kill(pids: Iterable[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def wait_for_memory(need: int, timeout: float, poll: float = 15.0) -> int:
    """Wait until ``MemAvailable`` is at least ``need`` bytes; return it. Raises ``TimeoutError`` after ``timeout``
    seconds, naming what was available."""
    deadline = time.monotonic() + timeout
    while (available := mem_available()) < need:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"MemAvailable stayed at {available / GB:.1f} GB for {timeout:.0f} s, below the {need / GB:.1f} GB "
                "this run may need: other processes are using the machine's memory; retry later or lower the budget"
            )
        print(f"waiting for memory: {available / GB:.1f} GB available, {need / GB:.1f} GB wanted", flush=True)
        time.sleep(poll)
    return available


@dataclass
class Guarded:
    """What happened to a guarded job."""

    returncode: int | None
    """The job's exit status; None when the guard stopped it."""
    stopped: str | None = None
    """Why the guard stopped the job: ``"budget"`` (its RSS exceeded the budget) or ``"machine"`` (MemAvailable fell
    below the margin); None if it ran to its end."""
    budget_bytes: int = 0
    margin_bytes: int = 0
    peak_rss_bytes: int = 0
    """The largest summed RSS of the job's processes seen by the guard (sampled every ``poll`` seconds)."""
    peak_rss_by_pid: dict[int, int] = field(default_factory=dict)
    min_mem_available_bytes: int = 0
    """The lowest MemAvailable seen while the job ran."""
    rss_at_stop_bytes: int = 0
    mem_available_at_stop_bytes: int = 0
    others_at_stop_bytes: int = 0
    """Memory used by the rest of the machine when the job was stopped (MemTotal − MemAvailable − the job's RSS)."""
    wall_s: float = 0.0

    def describe(self) -> str:
        if self.stopped is None:
            return f"ran to its end (exit {self.returncode}), peak RSS of the job {self.peak_rss_bytes / GB:.2f} GB"
        where = (
            f"the job reached {self.rss_at_stop_bytes / GB:.2f} GB of RSS, MemAvailable "
            f"{self.mem_available_at_stop_bytes / GB:.2f} GB, other processes {self.others_at_stop_bytes / GB:.2f} GB"
        )
        if self.stopped == "budget":
            return f"stopped: the job's RSS exceeded the {self.budget_bytes / GB:.1f} GB budget ({where})"
        return f"stopped: MemAvailable fell below the {self.margin_bytes / GIB:.1f} GiB margin ({where})"


def _mem_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def run_guarded(
    command: Sequence[str],
    *,
    budget: int,
    margin: int,
    env: Mapping[str, str] | None = None,
    poll: float = 0.2,
) -> Guarded:
    """Run ``command``, stopping it and every process it started if their summed RSS exceeds ``budget`` bytes or the
    machine's MemAvailable falls below ``margin`` bytes. Output goes to this process's stdout/stderr."""
    # Orphaned descendants (a worker whose launcher was killed) are re-parented to this process, not to init.
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    start = time.monotonic()
    job = subprocess.Popen(list(command), env=dict(env) if env is not None else None, start_new_session=True)
    result = Guarded(returncode=None, budget_bytes=budget, margin_bytes=margin, min_mem_available_bytes=mem_available())
    seen: set[int] = set()
    try:
        while True:
            rss = {pid: size for pid, size in tree_rss(os.getpid()).items() if pid != os.getpid()}
            seen |= rss.keys()
            if job.poll() is not None and not rss.keys() - {job.pid}:
                break  # the job and every process it started have ended
            available = mem_available()
            total = sum(rss.values())
            result.peak_rss_bytes = max(result.peak_rss_bytes, total)
            for pid, size in rss.items():
                result.peak_rss_by_pid[pid] = max(result.peak_rss_by_pid.get(pid, 0), size)
            result.min_mem_available_bytes = min(result.min_mem_available_bytes, available)
            reason = "budget" if total > budget else "machine" if available < margin else None
            if reason is not None:
                _kill(rss)
                result.stopped = reason
                result.rss_at_stop_bytes = total
                result.mem_available_at_stop_bytes = available
                result.others_at_stop_bytes = max(0, _mem_total() - available - total)
                break
            _reap(seen - {job.pid})
            time.sleep(poll)
    except BaseException:  # Ctrl-C or an error in the guard: never leave the job running unguarded
        _kill(tree_rss(os.getpid()).keys() - {os.getpid()})
        raise
    finally:
        result.wall_s = time.monotonic() - start
        job.wait()
        _reap(seen - {job.pid})
    _kill(tree_rss(os.getpid()).keys() - {os.getpid()})  # nothing of the job outlives it
    result.returncode = None if result.stopped else job.returncode
    return result


def _reap(pids: Iterable[int]) -> None:
    """Collect the exit status of re-parented descendants that ended (they would stay zombies otherwise)."""
    for pid in pids:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-gb", type=float, default=20.0, help="the job's summed RSS may not exceed this")
    parser.add_argument("--margin-gib", type=float, default=1.5, help="stop the job if MemAvailable falls below this")
    parser.add_argument("--wait-gb", type=float, help="wait for this much MemAvailable first (default: the budget)")
    parser.add_argument("--out", type=Path, help="write the outcome as JSON here")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    budget, margin = int(args.budget_gb * GB), int(args.margin_gib * GIB)
    wait_for_memory(int((args.wait_gb or args.budget_gb) * GB) + margin, timeout=1800.0)
    result = run_guarded(command, budget=budget, margin=margin)
    print(result.describe(), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(asdict(result)) + "\n")
    sys.exit(3 if result.stopped else (result.returncode or 0))


if __name__ == "__main__":
    main()
