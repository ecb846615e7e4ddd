#!/usr/bin/env bash
# Install autotune and its test tools into ./.venv, from scratch.
#
# Order matters: the CPU build of torch is pinned first (a plain `torch` requirement would pull a
# multi-GB CUDA build), and DeepSpeed builds against that torch without an isolated build
# environment (which would fetch another torch). Everything else comes from the project's
# pyproject.toml. On a CUDA machine, install the matching CUDA torch first and add '.[gpu]'.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
DEEPSPEED_SPEC=${DEEPSPEED_SPEC:-deepspeed==0.19.8}

"$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip setuptools wheel
.venv/bin/python -m pip install --quiet "$TORCH_SPEC"
.venv/bin/python -m pip install --quiet --no-build-isolation "$DEEPSPEED_SPEC"
.venv/bin/python -m pip install --quiet -e '.[test]'
# axolotl's own config loader validates the axolotl export in the tests. Its full install pulls
# CUDA-only packages (flash-attn, bitsandbytes, xformers); the loader itself needs only what is
# installed above plus addict, so axolotl is installed without its dependencies.
.venv/bin/python -m pip install --quiet --no-deps "axolotl==0.19.0" "addict==2.4.0"
.venv/bin/python -c "import torch, optuna, transformers, deepspeed; from axolotl.utils.config import validate_config; print('torch', torch.__version__, '| optuna', optuna.__version__, '| transformers', transformers.__version__, '| deepspeed', deepspeed.__version__)"
