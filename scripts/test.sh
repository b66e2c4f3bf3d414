#!/usr/bin/env bash
# The test command: set up .venv (pinned dependencies) and run the tests.
#   bash scripts/test.sh            everything (what CI runs): multi-process tests start real torchrun ranks
#                                   over gloo; network tests need root (skipped otherwise)
#   bash scripts/test.sh --fast     the single-process tier only (no torchrun ranks, no namespaces): the
#                                   edit-test loop, under a minute
# Further arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
if [ "${1:-}" = "--fast" ]; then
  shift
  exec .venv/bin/python -m pytest -q -m "not multiprocess and not network" "$@"
fi
exec .venv/bin/python -m pytest -q --durations=15 "$@"
