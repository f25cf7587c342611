#!/usr/bin/env bash
# The whole check: lint, types, the documentation's build, and the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet  # broken links, anchors or API references fail it
.venv/bin/python -m pytest "$@"
