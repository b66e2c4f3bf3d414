#!/usr/bin/env bash
# The test command: set up .venv (pinned dependencies), lint, and run the tests.
#   bash scripts/test.sh            everything (what CI runs): ruff, then the single-process tier (stopping at
#                                   its first failure), then the multi-process tests (real torchrun ranks over
#                                   gloo) and the network tests (root; skipped otherwise)
#   bash scripts/test.sh --fast     ruff and the single-process tier only (no torchrun ranks, no namespaces):
#                                   the edit-test loop, about a minute
# Further arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/ruff check --quiet .
fast=(-m "not multiprocess and not network")
if [ "${1:-}" = "--fast" ]; then
  shift
  exec .venv/bin/python -m pytest -q "${fast[@]}" "$@"
fi
.venv/bin/python -m pytest -q -x "${fast[@]}" "$@"
exec .venv/bin/python -m pytest -q --durations=15 -m "multiprocess or network" "$@"
