"""Shared helpers of the benchmarks: run a function on fresh gloo ranks, read a rank's memory high-water mark, count
tensor bytes, format results.

Not a benchmark itself; imported by ``step_time.py`` and ``collectives.py`` (which run with ``benchmarks/`` first on
``sys.path``).

* Ranks are started with the ``spawn`` method: each is a freshly ``exec``-ed interpreter, so its peak RSS is its own
  and environment variables glibc reads at process start (``MALLOC_MMAP_THRESHOLD_``) are honoured. The parent sets
  them in ``os.environ`` before starting the children, which inherit the environment.
* Rendezvous goes through a ``FileStore`` in a fresh temporary directory: no ports to pick, no races between runs.
"""

from __future__ import annotations

import argparse
import ctypes
import inspect
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import platform
import resource
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

CHILD_ENV: dict[str, str] = {
    # Serve every allocation >= 64 KiB with its own mmap and unmap it on free (this also switches off glibc's dynamic
    # threshold, which would otherwise climb to 32 MiB and keep freed tensors in the heap), so peak RSS tracks the
    # tensors that are really alive.
    "MALLOC_MMAP_THRESHOLD_": "65536",
    "OMP_NUM_THREADS": "1",
}
_MMAP_PROBE_BYTES = 8 * 2**20  # see mmap_threshold_active


@dataclass
class Run:
    """What ``run_ranks`` returns."""

    results: list[Any]
    """``fn``'s return value per rank, in rank order."""
    wall_s: float
    """From starting the first rank to the exit of the last one."""
    other_cpu_cores: float
    """CPUs the rest of the machine kept busy meanwhile, on average (the ranks' own CPU time excluded). Anything well
    above 0 means the timings were taken under contention."""


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    env: Mapping[str, str | None] | None = None,
    idle_wait: float = 0.0,
    timeout: float = 1800.0,
    max_other_cores: float = float("inf"),
    attempts: int = 1,
    backend: str = "gloo",
) -> Run:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes joined in a ``backend`` group (with
    nccl, rank r uses GPU r).

    The children's environment is this process's plus ``CHILD_ENV`` plus ``env`` (a ``None`` value removes the
    variable). First waits up to ``idle_wait`` seconds for the machine to be idle. A run during which other processes
    used more than ``max_other_cores`` CPUs is repeated, up to ``attempts`` runs in all; the least disturbed one is
    returned. ``fn`` must be a module-level function. Raises ``RuntimeError`` with the failing ranks' tracebacks if any
    rank fails, dies or exceeds ``timeout`` seconds (all ranks are then killed).
    """
    for key, value in {**CHILD_ENV, **(env or {})}.items():  # inherited at exec: glibc reads it before any malloc
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    runs: list[Run] = []
    for _ in range(max(1, attempts)):
        if idle_wait > 0:
            wait_until_idle(idle_wait)
        runs.append(_run_once(fn, world_size, args, timeout, backend))
        if runs[-1].other_cpu_cores <= max_other_cores:
            break
        print(f"  (other processes used {runs[-1].other_cpu_cores:.2f} CPU cores during the run)", flush=True)
    return min(runs, key=lambda run: run.other_cpu_cores)


def _run_once(fn: Callable[..., Any], world_size: int, args: tuple[Any, ...], timeout: float, backend: str) -> Run:
    start, busy = time.monotonic(), busy_cpu_seconds()
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="zero_bench_") as tmp:
        init_method = f"file://{os.path.join(tmp, 'store')}"
        procs, readers = [], []
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_entry, args=(fn, rank, world_size, init_method, args, writer, backend), daemon=True
            )
            proc.start()
            writer.close()
            procs.append(proc)
            readers.append(reader)
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        cpu_seconds: dict[int, float] = {}
        deadline = time.monotonic() + timeout
        pending = dict(enumerate(readers))
        while pending and not failures:
            ready = mpc.wait(list(pending.values()), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                failures.update({r: "timed out" for r in pending})
            for rank, reader in list(pending.items()):
                if reader in ready:
                    del pending[rank]
                    try:
                        ok, value, cpu_seconds[rank] = reader.recv()
                    except EOFError:
                        ok, value = False, f"died (exit code {procs[rank].exitcode})"
                    (results if ok else failures)[rank] = value
        for proc in procs:
            if failures and proc.is_alive():
                proc.kill()  # a peer is stuck in a collective that will never complete
            proc.join()
    if failures:
        raise RuntimeError("".join(f"\n--- rank {r} ---\n{msg}" for r, msg in sorted(failures.items())))
    wall = time.monotonic() - start
    others = (busy_cpu_seconds() - busy - sum(cpu_seconds.values())) / wall
    return Run([results[r] for r in range(world_size)], wall, max(0.0, others))


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    init_method: str,
    args: tuple[Any, ...],
    conn: Any,
    backend: str = "gloo",
) -> None:
    message: tuple[bool, Any]
    try:
        torch.set_num_threads(1)  # two ranks on two cores: one compute thread each
        if backend == "nccl":  # one GPU per rank (one node): the device every rank_device() call returns
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timedelta(minutes=10)
        )
        dist.barrier()
        message = (True, fn(rank, world_size, *args))
        dist.barrier()
    except BaseException:
        message = (False, traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    conn.send((*message, own_cpu_seconds()))


def memory_status() -> dict[str, int]:
    """This process's memory in bytes: ``VmHWM`` (peak RSS of the current address space), ``VmRSS`` (now) from
    ``/proc/self/status``, and ``ru_maxrss`` (peak RSS as the kernel's rusage reports it)."""
    status: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                status[key] = int(value.split()[0]) * 1024
    status["ru_maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return status


def mmap_threshold_active() -> bool:
    """True if ``MALLOC_MMAP_THRESHOLD_`` was in this process's environment at exec (when glibc reads it) and glibc
    serves an 8 MiB ``malloc`` with mmap (so: true for any fixed threshold up to 8 MiB).

    Call it after some tensor traffic: glibc's default *dynamic* threshold has then risen (up to 32 MiB) past the
    largest freed tensor and serves the probe from the heap, while a fixed 64 KiB threshold still mmaps it. A glibc
    chunk's size word sits just before the pointer; bit 1 (``IS_MMAPPED``) marks mmap-served chunks.
    """
    with open("/proc/self/environ", "rb") as f:
        at_exec = any(entry.startswith(b"MALLOC_MMAP_THRESHOLD_=") for entry in f.read().split(b"\0"))
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    ptr = libc.malloc(_MMAP_PROBE_BYTES)
    try:
        return at_exec and bool(ctypes.c_size_t.from_address(ptr - ctypes.sizeof(ctypes.c_size_t)).value & 0x2)
    finally:
        libc.free(ptr)


def busy_cpu_seconds() -> float:
    """CPU-seconds all processes on the machine have spent busy since boot (``/proc/stat``)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU-seconds this process (all its threads) has used so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def wait_until_idle(max_wait: float, busy_cores: float = 0.25, interval: float = 2.0) -> float:
    """Wait up to ``max_wait`` seconds for other processes to use fewer than ``busy_cores`` CPUs (measured over
    ``interval`` seconds), so that a measurement does not start while someone else is computing. Returns the busy
    cores of the last interval."""
    deadline = time.monotonic() + max_wait
    while True:
        start = busy_cpu_seconds()
        time.sleep(interval)
        busy = (busy_cpu_seconds() - start) / interval
        if busy < busy_cores or time.monotonic() >= deadline:
            return busy


def machine_info() -> dict[str, Any]:
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "cpu": _cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "backend": "gloo",
        "child_env": {key: os.environ.get(key) for key in CHILD_ENV},  # as the last run_ranks() set it
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor()


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """``--device cpu|cuda --backend gloo|nccl``: where the benchmark's ranks compute and communicate."""
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one GPU per rank")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default=None, help="default: nccl on cuda, else gloo")


def add_contention_arguments(parser: argparse.ArgumentParser) -> None:
    """``--idle-wait``, ``--max-other-cores``, ``--attempts``: how ``run_ranks`` waits for an idle machine and re-runs a
    measurement that other processes disturbed."""
    parser.add_argument("--idle-wait", type=float, default=120.0, help="max seconds to wait for an idle machine")
    parser.add_argument("--max-other-cores", type=float, default=0.25, help="rerun a run others disturbed more")
    parser.add_argument("--attempts", type=int, default=3, help="runs at most, per measurement, see --max-other-cores")


def add_mmap_threshold_argument(parser: argparse.ArgumentParser) -> None:
    """``--mmap-threshold``: the ranks' ``MALLOC_MMAP_THRESHOLD_`` (see ``mmap_threshold_active``)."""
    parser.add_argument(
        "--mmap-threshold", type=int, default=65536, help="MALLOC_MMAP_THRESHOLD_ of the ranks; 0: glibc's default"
    )


def check_device_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill in the backend and refuse combinations that cannot run, naming the flag and the fix."""
    args.backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    if args.backend == "nccl" and args.device != "cuda":
        parser.error("--backend nccl needs --device cuda (NCCL communicates GPU tensors only)")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False on this machine. HINT: use --device cpu")
    world = getattr(args, "world_size", 0)
    if args.device == "cuda" and world > torch.cuda.device_count():
        parser.error(f"--world-size {world} > {torch.cuda.device_count()} GPUs here: one GPU per rank")


def rank_device(device_type: str) -> torch.device:
    """This rank's device: its GPU (set in ``_entry``) or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a host clock measures it (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tensor_bytes(tensors: list[Tensor]) -> int:
    """Bytes of distinct storages (a flat buffer and its views count once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def adam_state(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """Per-element optimizer state tensors (the 0-dim step counters are bookkeeping)."""
    return [v for s in optimizer.state.values() for v in s.values() if isinstance(v, Tensor) and v.dim() > 0]


class TrafficMeter:
    """Bytes this rank sends through ``torch.distributed``'s Python collectives, per step, for peers that keep no
    record of their own (FSDP2, DeepSpeed). Each collective is charged what a bandwidth-optimal algorithm sends,
    the same accounting as our ``CommLedger``: all-gather (N−1)·input, reduce-scatter and all-to-all (N−1)/N·input,
    all-reduce 2·(N−1)/N·tensor, broadcast (N−1)·tensor from its source, a point-to-point send its tensor.
    Collectives issued from C++ (DDP's reducer) are invisible to it. ``install()`` must run before the peer is
    built, since some capture the functions then; a call nested in another counted one (a deprecated alias
    forwarding to its successor) counts once."""

    def __init__(self) -> None:
        self.current: dict[str, int] = {}
        self.last_step: dict[str, int] = {}
        self._depth = 0

    def install(self) -> None:
        def gathered(w: int, a: dict[str, Any]) -> int:
            return _nbytes(_arg(a, 1)) * (w - 1)

        def scattered(w: int, a: dict[str, Any]) -> int:
            inp = _arg(a, 1)
            return (sum(map(_nbytes, inp)) if isinstance(inp, (list, tuple)) else _nbytes(inp)) * (w - 1) // w

        def broadcast(w: int, a: dict[str, Any]) -> int:
            src, group = a.get("src"), a.get("group")
            if src is None and a.get("group_src") is not None:
                src = dist.get_global_rank(group or dist.group.WORLD, a["group_src"])
            return _nbytes(_arg(a, 0)) * (w - 1) if src == dist.get_rank() else 0

        charges: dict[str, Callable[[int, dict[str, Any]], int]] = {
            "all_gather_into_tensor": gathered,
            "all_gather_single": gathered,
            "_all_gather_base": gathered,
            "all_gather": gathered,
            "reduce_scatter_tensor": scattered,
            "reduce_scatter_single": scattered,
            "_reduce_scatter_base": scattered,
            "reduce_scatter": scattered,
            "all_to_all_single": scattered,
            "all_reduce": lambda w, a: 2 * _nbytes(_arg(a, 0)) * (w - 1) // w,
            "broadcast": broadcast,
            "isend": lambda w, a: _nbytes(_arg(a, 0)),
        }
        for module in (dist, dist.distributed_c10d):
            for name, charge in charges.items():
                original = getattr(module, name, None)
                if original is not None and not getattr(original, "_metered", False):
                    setattr(module, name, self._metered(name, original, charge))

    def _metered(
        self, name: str, original: Callable[..., Any], charge: Callable[[int, dict[str, Any]], int]
    ) -> Callable[..., Any]:
        signature = inspect.signature(original)

        def call(*args: Any, **kwargs: Any) -> Any:
            if self._depth == 0:
                arguments = signature.bind(*args, **kwargs).arguments
                group = arguments.get("group")
                world = dist.get_world_size(group) if group is not None else dist.get_world_size()
                self.current[name] = self.current.get(name, 0) + charge(world, arguments)
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        call._metered = True  # type: ignore[attr-defined]
        return call

    def start_step(self) -> None:
        self.last_step, self.current = self.current, {}


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _arg(arguments: dict[str, Any], position: int) -> Any:
    """The ``position``-th bound argument of a collective (its output, input or tensor)."""
    return list(arguments.values())[position]


def ring_all_reduce_bytes(numel: int, world: int, element_size: int = 4) -> int:
    return 2 * numel * element_size * (world - 1) // world


Column = tuple[str, Callable[[dict[str, Any]], Any], str, bool]
"""A results-table column: header, value of one row's record, format, whether to add a ratio-to-baseline column."""


def ratio_table(records: Mapping[str, dict[str, Any]], columns: list[Column], baseline: str, ratio_title: str) -> str:
    """Markdown table with a row per record; numeric columns flagged in ``columns`` get a ratio to ``baseline``."""
    base = records.get(baseline)
    header, rows = ["variant"], [[name] for name in records]
    for title, value, fmt, ratio in columns:
        header += [title, ratio_title] if ratio else [title]
        for row, record in zip(rows, records.values(), strict=True):
            row.append(fmt.format(value(record)))
            if ratio:
                row.append(f"{value(record) / value(base):.2f}×" if base and value(base) else "–")
    return markdown_table(header, rows)


def joined(values: list[float], fmt: str, scale: float = 1.0) -> str:
    return " / ".join(fmt.format(v * scale) for v in values)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def summarize(values: list[float]) -> Mapping[str, float]:
    ordered = sorted(values)
    return {"median": _median(ordered), "min": ordered[0], "max": ordered[-1]}


def _median(ordered: list[float]) -> float:
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
