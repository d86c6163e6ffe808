#!/usr/bin/env bash
# Lightning's own tests for its DDP strategy, registry, accelerator connector, launchers and manual optimization, the
# tests of callbacks, checkpointing, loggers, models, the trainer, loops, the tuner and utilities that use DDP, and
# Fabric's strategy, connector and Fabric tests, run with DDPPlusStrategy / DDPPlusFabricStrategy in place of the
# stock DDP strategies (compat/ddp_plus_swap.py). Not part of CI (about 8 minutes on 2 cores). Some of Lightning's
# tests need its test requirements (cloudpickle, scikit-learn, pandas, tensorboard).
#
#   compat/run_lightning_tests.sh [TAG]        # TAG: the Lightning release to take the tests from (default: installed)
#   LIGHTNING_REPO=/path/to/pytorch-lightning compat/run_lightning_tests.sh   # a local clone instead of GitHub
#
# Prints passed / failed; compare the failures with compat/intended_failures.md.
set -euo pipefail
cd "$(dirname "$0")/.."
TAG=${1:-$(python -c "import lightning; print(lightning.__version__)")}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
if [ -n "${LIGHTNING_REPO:-}" ]; then
  # the tests' own tree only: a mirror may lack other large files (a shallow or partial clone)
  git -C "$LIGHTNING_REPO" archive --prefix=tests/tests_pytorch/ "$TAG:tests/tests_pytorch" | tar -x -C "$WORK"
  git -C "$LIGHTNING_REPO" archive --prefix=tests/tests_fabric/ "$TAG:tests/tests_fabric" | tar -x -C "$WORK"
else
  git clone --quiet --depth 1 --branch "$TAG" https://github.com/Lightning-AI/pytorch-lightning "$WORK/repo"
  mv "$WORK/repo/tests" "$WORK/tests"
fi
cd "$WORK/tests"
# each run fails on the intended failures (compat/intended_failures.md), so each is followed by the next
swapped() { PYTHONPATH="$OLDPWD:$WORK/tests" python -m pytest -p compat.ddp_plus_swap -q -p no:cacheprovider --timeout=300 "$@"; }
swapped \
  tests_pytorch/strategies/test_ddp.py tests_pytorch/strategies/test_ddp_integration.py \
  tests_pytorch/strategies/test_ddp_integration_comm_hook.py tests_pytorch/strategies/test_registry.py \
  tests_pytorch/strategies/test_common.py tests_pytorch/strategies/test_custom_strategy.py \
  tests_pytorch/strategies/launchers tests_pytorch/trainer/connectors/test_accelerator_connector.py \
  tests_pytorch/trainer/optimization/test_manual_optimization.py "${@:2}" -rf 2>&1 | tee "$WORK/log" | tail -80 || true
# the tests of the rest of the Trainer that use DDP (a process group, a spawn, SIGTERM, the stepping estimate)
swapped tests_pytorch/callbacks tests_pytorch/checkpointing tests_pytorch/loggers tests_pytorch/models \
  tests_pytorch/trainer tests_pytorch/loops tests_pytorch/tuner tests_pytorch/utilities --continue-on-collection-errors \
  -k "ddp or spawn or distributed or sigterm or estimated_stepping" -rf 2>&1 | tee "$WORK/log_trainer" | tail -40 || true
swapped tests_fabric/strategies tests_fabric/test_connector.py tests_fabric/test_fabric.py -rf 2>&1 \
  | tee "$WORK/log_fabric" | tail -40 || true
