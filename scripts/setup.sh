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
# LitGPT's own fine-tuning scripts run unchanged in the test suite (tests/test_litgpt_scripts.py). --no-deps: litgpt
# 0.5.13 declares huggingface-hub<1.4 and psutil==7.2.2, which would downgrade what the dev extras install
# (transformers 5 needs huggingface-hub 1.x; litgpt runs with it); its other requirements (tokenizers, safetensors,
# lightning, torchmetrics, tqdm) come with the dev extras. jsonargparse with its "signatures" extra is the one left:
# the scripts save their hyper-parameters by parsing their own signatures, and litgpt pins it to >=4.37,<=4.41.
.venv/bin/python -m pip install --quiet --no-deps "litgpt==0.5.13"
.venv/bin/python -m pip install --quiet "jsonargparse[signatures]>=4.37,<=4.41"
