#!/usr/bin/env bash
# Create .venv with the project and its dev tools. torch is pinned to the CPU build that this machine has on disk;
# the package itself accepts any torch>=2.6.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[dev]"
