#!/usr/bin/env bash
# The lowest torch and Lightning that pyproject.toml declares, in their own virtual environment, with the suite that
# CI runs for the lowest Lightning (every module). Not part of CI: torch's older releases on the package index are
# CUDA builds with several GB of dependencies.
#
#   compat/test_lowest_versions.sh [VENV_DIR]      # default: a temporary directory, removed afterwards
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH=$(python3 -c "import re; print(re.search(r'\"torch>=([0-9.]+)', open('pyproject.toml').read()).group(1))")
LIGHTNING=$(python3 -c "import re; print(re.search(r'\"lightning>=([0-9.]+)', open('pyproject.toml').read()).group(1))")
VENV=${1:-$(mktemp -d)/venv}
echo "lowest declared: torch ${TORCH}, lightning ${LIGHTNING}; environment: ${VENV}"
python3 -m venv "$VENV" && . "$VENV/bin/activate"
pip install -q "torch==${TORCH}.0" || pip install -q "torch==${TORCH}"
pip install -q -e ".[test]" "torch==$(python -c 'import torch; print(torch.__version__.split("+")[0])')" "lightning==${LIGHTNING}"
pip install -q numpy  # older torch wheels do not pull it in
python -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__)"
python -m pytest -q -p no:cacheprovider -m "not multiprocess"
python -m pytest -q -p no:cacheprovider -m multiprocess tests/test_accumulation.py tests/test_conflicts.py \
  tests/test_ddp_training.py tests/test_diagnostics.py tests/test_fabric.py tests/test_wrapper.py tests/test_zoo.py \
  tests/test_buckets.py tests/test_comm_hooks.py
