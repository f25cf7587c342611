"""``python -m lightning_zero fabric-run [OPTIONS] SCRIPT [SCRIPT_ARGS]``: Lightning Fabric's ``fabric run`` with ZeRO's
strategy names (``--strategy zero3``).

Fabric's own ``fabric run`` command takes its ``--strategy`` choices from Fabric's registry when it is imported, before
any user code could register ZeRO's, so it refuses ``zero3``. This command registers them first, parses the options
with Fabric's own command (the same options, the same defaults) and launches through Fabric's torchrun launcher; each
process runs ``fabric_script.py``, which registers the names there too (the script's ``Fabric()`` reads the strategy
the launcher passes) and then runs ``SCRIPT`` as ``__main__``. So a Fabric script needs no ``import lightning_zero``::

    python -m lightning_zero fabric-run --strategy zero3 --accelerator cpu --devices 2 train.py --lr 3e-4
"""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path

from lightning.fabric import cli as fabric_cli
from lightning.fabric.strategies import STRATEGY_REGISTRY

from lightning_zero.compat import fabric_run_command
from lightning_zero.fabric.strategy import ZeroFabricStrategy

SCRIPT = Path(__file__).resolve().parent / "fabric_script.py"
"""What each process runs: registers ZeRO's strategies with Fabric, then runs the user's script."""


def main(argv: list[str]) -> int:
    ZeroFabricStrategy.register_strategies(STRATEGY_REGISTRY)  # before Fabric's command reads the registry
    command = fabric_run_command()
    context = command.make_context("python -m lightning_zero fabric-run", list(argv))
    params = dict(context.params)
    script_args = [str(params.pop("script")), *params.pop("script_args")]
    fabric_cli.main(Namespace(script=str(SCRIPT), **params), script_args)
    return 0
