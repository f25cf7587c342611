"""Shared pytest configuration: ``gpu`` / ``gpus(n)`` / ``slow`` markers and an importable ``tests`` package.

Convention: test modules import the harness as ``from tests.harness import run_distributed`` (``tests`` is a
package, see ``tests/__init__.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# pytest's default "prepend" import mode already puts the repo root on sys.path because ``tests`` is a package;
# doing it explicitly keeps ``import tests.harness`` (and ``lightning_zero``) working under ``--import-mode=importlib``
# too. Ranks started by the harness receive this sys.path, so they can unpickle functions from test modules.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tests import harness  # noqa: E402  (needs the path above)

# What nearly every rank of the suite imports, imported once by the harness's forkserver instead of in each rank.
harness.PRELOAD += [
    "lightning_zero",
    "omegaconf",  # Lightning imports it in every checkpoint save (``dump_checkpoint``)
    "s3fs",  # ... and this in every ``ModelCheckpoint.setup`` (``_is_object_storage``), where it is installed
    "transformers.modeling_utils",  # the Hugging Face models and peft adapters of the parity tests
    "peft",
]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", default=False, help="also run tests marked @pytest.mark.slow")


def pytest_configure(config: pytest.Config) -> None:
    # Registered here (not only in pyproject) so ``--strict-markers`` accepts them wherever pytest is run from.
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped when torch.cuda.is_available() is False")
    config.addinivalue_line(
        "markers", "gpus(n): needs n CUDA devices (one NCCL rank per GPU); skipped, saying so, on a machine with fewer"
    )
    config.addinivalue_line("markers", "slow: long-running; skipped unless --runslow is given")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_slow = None if config.getoption("--runslow") else pytest.mark.skip(reason="slow test: use --runslow")
    # device_count() asks the driver without creating a CUDA context: the ranks the harness forks start clean.
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_gpu = None if gpus else pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if skip_slow is not None and item.get_closest_marker("slow") is not None:
            item.add_marker(skip_slow)
        if skip_gpu is not None and item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)
        needs = item.get_closest_marker("gpus")
        if needs is not None and gpus and gpus < needs.args[0]:
            reason = f"needs {needs.args[0]} GPUs (NCCL refuses two ranks on one GPU); this machine has {gpus}"
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def _no_inherited_rendezvous_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's multiprocessing launcher writes the port it picked into this process's ``MASTER_PORT`` and the
    next launch reuses it, while the last group's store may still hold it (EADDRINUSE); every test starts without
    one, and restores what was there."""
    monkeypatch.delenv("MASTER_PORT", raising=False)
