"""``FaultWatch``: a strategy's fault monitor (``comm/fault_monitor.py``), started once the process group exists,
told of the run's exception so that it names this rank in the other ranks' errors, and stopped at the end.

The Trainer's strategy hears of an exception in its ``on_exception`` hook. A Fabric loop's exception reaches no
strategy hook: the watch sees it as it leaves the script, through ``sys.excepthook`` (``catch_uncaught=True``), and
restores the previous hook when it stops.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import TracebackType
from typing import Any

from lightning_zero.comm.fault_monitor import FaultMonitor

ExceptHook = Callable[[type[BaseException], BaseException, TracebackType | None], Any]


class FaultWatch:
    """One strategy's ``FaultMonitor``, from ``start`` (after the process group) to ``stop``."""

    def __init__(self, catch_uncaught: bool = False) -> None:
        self._catch_uncaught = catch_uncaught
        self._monitor: FaultMonitor | None = None
        self._excepthook: ExceptHook | None = None

    def start(self) -> None:
        """Start the monitor on the default process group, if there is one and it is not running yet."""
        if self._monitor is not None:
            return
        self._monitor = FaultMonitor.from_default_group()
        if self._monitor is None:
            return
        self._monitor.start()
        if self._catch_uncaught:
            self._excepthook = sys.excepthook
            sys.excepthook = self._on_uncaught_exception

    def on_exception(self, exception: BaseException) -> None:
        if self._monitor is not None:
            self._monitor.on_exception(exception)  # adds the note naming the rank at fault

    def stop(self) -> None:
        if self._monitor is not None:
            self._monitor.stop()
            self._monitor = None
        if self._excepthook is not None:
            sys.excepthook = self._excepthook
            self._excepthook = None

    def _on_uncaught_exception(
        self, kind: type[BaseException], exception: BaseException, traceback: TracebackType | None
    ) -> Any:
        self.on_exception(exception)
        previous = self._excepthook or sys.__excepthook__
        return previous(kind, exception, traceback)
