"""Run by each process of ``python -m lightning_zero fabric-run`` (``cli/fabric_run.py``): registers ZeRO's strategies
with Fabric, so that the script's ``Fabric()`` finds the ``--strategy zero3`` the launcher passes it, then runs the
script given as the first argument as ``__main__``, as ``python SCRIPT ARGS`` would."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from lightning.fabric.strategies import STRATEGY_REGISTRY

from lightning_zero.fabric.strategy import ZeroFabricStrategy


def run() -> None:
    ZeroFabricStrategy.register_strategies(STRATEGY_REGISTRY)
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = str(Path(script).resolve().parent)  # the script's directory, not this one
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    run()
