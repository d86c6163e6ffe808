#!/usr/bin/env bash
# The newest torch releases the package declares (2.14.1, 2.15.0), each in its own virtual environment, with the
# newest Lightning: the type check, every test without processes, then the multi-process tests. Not part of CI:
# these are CUDA builds of several GB (2.14.1 lies on the CI machines' disk, 2.15.0 is a download), more than CI's
# 25 minutes allow beside the suite.
#
#   compat/test_newest_torch.sh [TORCH_VERSION ...]     # default: 2.14.1 2.15.0
#
# These machines cap pip at torch<=2.14.1 (/etc/xdg/pip/constraints.txt); for 2.15.0 the script lifts the cap for
# its own pip commands only (PIP_CONSTRAINT pointing at an empty file), never by editing the machine's files.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSIONS=("$@")
[ ${#VERSIONS[@]} -eq 0 ] && VERSIONS=(2.14.1 2.15.0)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
: > "$WORK/no-constraints.txt"
for VERSION in "${VERSIONS[@]}"; do
  VENV="$WORK/torch-$VERSION"
  echo "=== torch $VERSION: environment $VENV"
  python3 -m venv "$VENV"
  PIP_CONSTRAINT="$WORK/no-constraints.txt" "$VENV/bin/pip" install -q "torch==$VERSION"
  PIP_CONSTRAINT="$WORK/no-constraints.txt" "$VENV/bin/pip" install -q -e ".[test]" "torch==$VERSION"
  "$VENV/bin/python" -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__)"
  "$VENV/bin/mypy"
  "$VENV/bin/python" -m pytest -q -p no:cacheprovider -m "not multiprocess"
  "$VENV/bin/python" -m pytest -q -p no:cacheprovider -m multiprocess
done
