"""Lightning's per-device processes inside a Hydra job: single runs and every job of a ``--multirun`` sweep.

    @hydra.main(...)
    def main(cfg):
        with HydraJob() as job:
            trainer = instantiate(cfg.trainer, default_root_dir=job.output_dir)
            job.attach(trainer)
            trainer.fit(model, data)

Note [Hydra multirun and Lightning's relaunch]
A strategy launched like torchrun (``ddp``, ``zero1``, ``zero2``, ...) starts local ranks 1..N-1 by running the
command line again (Lightning's ``_SubprocessScriptLauncher``), under Hydra with ``hydra.run.dir=<run dir>`` appended.
In a ``--multirun`` sweep that breaks in two ways:

1. The command line is the *sweep*: every child starts all of the sweep's jobs itself, in the run directory rather
   than the job's, and pairs up with the wrong peers (Lightning's own support for this was reverted).
   ``JobLauncher`` starts each child as a single run of the *current job* instead: the job's own overrides
   (``hydra.overrides.task``, e.g. ``strategy=zero1`` rather than ``strategy=zero1,zero2``), the job's output
   directory as ``hydra.run.dir``, ``hydra.mode=RUN``, no sweeper or launcher settings, and
   ``hydra.output_subdir=null`` so the job's ``.hydra/`` record is written once, by rank 0. Config-selecting flags
   (``--config-name``, ``--config-dir``, ...) are kept.
2. Hydra's basic launcher runs the jobs one after another in one process, so the second job inherits what the first
   left: ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_PORT`` in ``os.environ`` (Lightning then believes an external
   launcher started it and never starts its own children; the sweep hangs) and an initialized default process
   group (which Lightning would reuse, with peers that have exited). ``HydraJob`` undoes this when the job ends: it
   waits for the job's children, destroys the process group and restores ``os.environ``.

Processes started externally (torchrun, srun under SLURM, submitit) are left alone: Lightning starts no children
there, and each process runs every job of a sweep itself, so only the clean-up between jobs applies.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import lightning.pytorch as pl
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from typing_extensions import override

from lightning_zero.compat import SubprocessScriptLauncher as _SubprocessScriptLauncher

# Hydra settings that belong to the sweep, or that the child sets itself: never passed on to a child.
_SWEEP_KEYS = (
    "hydra.mode",
    "hydra.run",
    "hydra.sweep",
    "hydra.sweeper",
    "hydra/sweeper",
    "hydra.launcher",
    "hydra/launcher",
    "hydra.job.name",
    "hydra.job.num",
    "hydra.job.id",
    "hydra.output_subdir",
)


def _config_flags(argv: Sequence[str]) -> list[str]:
    """The flags of a Hydra command line that choose the config (name, path, extra dir), as ``--flag=value``."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--config-path", "-cp")
    parser.add_argument("--config-name", "-cn")
    parser.add_argument("--config-dir", "-cd")
    known, _ = parser.parse_known_args(argv)
    return [f"--{name.replace('_', '-')}={value}" for name, value in vars(known).items() if value is not None]


def _is_sweep_setting(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in _SWEEP_KEYS)


def _quote(value: str) -> str:
    # Hydra's override grammar: a quoted value may contain '=', ',', spaces, ':' and so on.
    return '"' + value.replace('"', '\\"') + '"'


def job_overrides(
    argv: Sequence[str],
    task_overrides: Sequence[str],
    hydra_overrides: Sequence[str],
    output_dir: str,
    job_name: str,
    local_rank: int,
) -> list[str]:
    """Arguments that re-run exactly one Hydra job as a single run in ``output_dir``. See Note [Hydra multirun and
    Lightning's relaunch].

    ``argv`` is the original command line (without the script), ``task_overrides`` and ``hydra_overrides`` are the
    job's ``hydra.overrides.task`` and ``hydra.overrides.hydra``.
    """
    parsed = OverridesParser.create().parse_overrides(list(hydra_overrides))
    kept = [line for line, o in zip(hydra_overrides, parsed, strict=True) if not _is_sweep_setting(o.key_or_group)]
    return [
        *_config_flags(argv),
        *task_overrides,
        *kept,
        "hydra.mode=RUN",
        f"hydra.run.dir={_quote(output_dir)}",
        f"hydra.job.name={job_name}_rank{local_rank}",  # its log file: <output_dir>/<job>_rank<k>.log
        "hydra.output_subdir=null",
    ]


def _script_command() -> list[str]:
    """How this program was started: ``python -m module`` or ``python /abs/path/script.py`` (as Lightning does)."""
    import __main__  # at call time, as Lightning does: runners such as runpy replace __main__ after our import

    spec = getattr(__main__, "__spec__", None)
    if spec is not None:
        return [sys.executable, "-m", spec.name]
    return [sys.executable, os.path.abspath(sys.argv[0])]


class JobLauncher(_SubprocessScriptLauncher):
    """Lightning's subprocess launcher, starting every other local rank as a single run of the current Hydra job."""

    @override
    def _call_children_scripts(self) -> None:
        # Lightning's own method, except for the command: see Note [Hydra multirun and Lightning's relaunch].
        self._check_can_spawn_children()
        self.procs = []
        os.environ["MASTER_ADDR"] = self.cluster_environment.main_address
        os.environ["MASTER_PORT"] = str(self.cluster_environment.main_port)
        os.environ["NODE_RANK"] = str(self.cluster_environment.node_rank())
        os.environ["LOCAL_RANK"] = str(self.cluster_environment.local_rank())
        os.environ["WORLD_SIZE"] = f"{self.num_processes * self.num_nodes}"
        hydra = HydraConfig.get()
        for local_rank in range(1, self.num_processes):
            env = {**os.environ, "LOCAL_RANK": str(local_rank)}
            args = job_overrides(
                sys.argv[1:],
                list(hydra.overrides.task),
                list(hydra.overrides.hydra),
                hydra.runtime.output_dir,
                hydra.job.name,
                local_rank,
            )
            # The original working directory: relative paths on the command line mean the same to every rank.
            self.procs.append(subprocess.Popen([*_script_command(), *args], env=env, cwd=hydra.runtime.cwd))


class HydraJob:
    """One Hydra job's Lightning processes: started as this job (``attach``) and cleaned up when it ends.

    Use as a context manager around everything the job does, so that the next job of a sweep starts from the same
    process state as the first. See Note [Hydra multirun and Lightning's relaunch].
    """

    def __init__(self, child_timeout: float = 120.0) -> None:
        self.child_timeout = child_timeout
        """Seconds the job's other local ranks get to exit after this one finished, before they are killed."""
        self._environ: dict[str, str] = {}
        self._launchers: list[JobLauncher] = []

    @property
    def output_dir(self) -> Path:
        """The job's Hydra output directory (the working directory outside Hydra)."""
        return Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else Path.cwd()

    def __enter__(self) -> HydraJob:
        self._environ = dict(os.environ)
        return self

    def attach(self, trainer: pl.Trainer) -> None:
        """Make ``trainer`` start its other local ranks as this Hydra job (no-op outside Hydra or without children).

        Call after building the Trainer and before ``fit``.
        """
        strategy = trainer.strategy
        launcher = strategy.launcher
        if not HydraConfig.initialized() or type(launcher) is not _SubprocessScriptLauncher:
            return
        job_launcher = JobLauncher(launcher.cluster_environment, launcher.num_processes, launcher.num_nodes)
        # Lightning's strategies create their launcher while the Trainer is built and keep it in ``_launcher``; there
        # is no public setter.
        strategy._launcher = job_launcher
        self._launchers.append(job_launcher)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        try:
            for launcher in self._launchers:
                if exc is None:
                    _reap(launcher.procs, timeout=self.child_timeout)
                else:  # they may be blocked in a collective with us; the job's own error is the one to see
                    _kill(launcher.procs)
        finally:
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
            os.environ.clear()
            os.environ.update(self._environ)


def _kill(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _reap(procs: Sequence[subprocess.Popen[bytes]], timeout: float) -> None:
    """Wait up to ``timeout`` seconds for the job's other local ranks; kill any still running; raise if one failed."""
    deadline = time.monotonic() + timeout
    failures: list[str] = []
    for local_rank, proc in enumerate(procs, start=1):
        try:
            code = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            failures.append(f"local rank {local_rank} (pid {proc.pid}) still ran {timeout:g} s later; killed")
            continue
        if code != 0:
            failures.append(f"local rank {local_rank} (pid {proc.pid}) exited with code {code}")
    if failures:
        raise RuntimeError(
            "The Hydra job finished on local rank 0, but " + "; ".join(failures) + ". HINT: its output is above and "
            "in <job output dir>/<job name>_rank<k>.log."
        )
