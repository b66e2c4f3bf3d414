#!/usr/bin/env bash
# The test command: set up .venv (pinned dependencies), lint, and run the tests.
#   bash scripts/test.sh            everything (what CI runs): ruff, then the single-process tier (stopping at
#                                   its first failure), then the multi-process tests (real torchrun ranks over
#                                   gloo) and the network tests (root; skipped otherwise), in one pytest session
#   bash scripts/test.sh --fast     ruff and the single-process tier only (no torchrun ranks, no namespaces):
#                                   the edit-test loop, about a minute
# Further arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/ruff check --quiet .
if [ "${1:-}" = "--fast" ]; then
  shift
  exec .venv/bin/python -m pytest -q -m "not multiprocess and not network" "$@"
fi
exec .venv/bin/python -m pytest -q --tiered --durations=15 "$@"
