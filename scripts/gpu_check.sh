#!/usr/bin/env bash
# What a GPU machine has to teach the project, in one command of at most 8 minutes on one H100:
#   bash scripts/gpu_check.sh OUT                      # a GPU machine, OUT its output folder
#   bash scripts/gpu_check.sh --device cpu --dry OUT   # tiny sizes on the CPU (tests/test_gpu_check.py)
# OUT gets summary.json and summary.md (rewritten after every section) and pytest_gpu.log.
# See benchmarks/gpu_check/main.py and benchmarks/README.md, "What has run on GPUs".
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
export PYTHONUNBUFFERED=1
exec "$PYTHON" benchmarks/gpu_check/main.py "$@"
