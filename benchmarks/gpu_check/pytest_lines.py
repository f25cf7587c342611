"""A pytest plugin of the GPU check: each test's outcome as one JSON line, written as soon as it is known, to the
file named by ``GPU_CHECK_PYTEST_LINES`` (so that a run killed at its budget still tells what finished)."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest


def _write(line: dict[str, Any]) -> None:
    path = os.environ.get("GPU_CHECK_PYTEST_LINES")
    if path:
        with open(path, "a") as file:
            file.write(json.dumps(line) + "\n")


def pytest_collection_finish(session: pytest.Session) -> None:
    _write({"collected": [item.nodeid for item in session.items]})


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when != "call" and report.outcome == "passed":
        return
    line: dict[str, Any] = {"test": report.nodeid, "when": report.when, "outcome": report.outcome,
                            "seconds": round(report.duration, 2)}  # fmt: skip
    if report.skipped and isinstance(report.longrepr, tuple):
        line["reason"] = str(report.longrepr[2]).removeprefix("Skipped: ")
    elif report.failed:
        line["error"] = report.longreprtext[-2500:]
    _write(line)
