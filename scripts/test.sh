#!/usr/bin/env bash
# The test command: set up .venv (pinned dependencies), lint, and run the tests.
#   bash scripts/test.sh            what CI runs: ruff; then, in a pytest session of its own started at once,
#                                   the network tests (root; skipped otherwise) and the multi-process tests
#                                   marked waiting, which mostly wait (on ssh, Slurm, emulated links, a hang, a
#                                   timeout, a signal); beside it the single-process tier (stopping at its first
#                                   failure) and then the multi-process tests (real torchrun ranks over gloo).
#                                   The second session's output follows.
#   bash scripts/test.sh --all      the same with the extended tests too (marker extended: the further
#                                   precisions, layouts and modes of runs the core tests already launch once
#                                   per system, the longer fault and shaping cases, the calibration's
#                                   sensitivity; about 12 minutes more)
#   bash scripts/test.sh --fast     ruff and the single-process tier only (no torchrun ranks, no namespaces):
#                                   the edit-test loop, about three minutes
# Further arguments go to every pytest session.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/ruff check --quiet .
PYTEST=(.venv/bin/python -m pytest -q)
if [ "${1:-}" = "--fast" ]; then
  shift
  exec "${PYTEST[@]}" -m "not multiprocess and not network and not extended" "$@"
fi
EXTENDED="and not extended"
if [ "${1:-}" = "--all" ]; then
  shift
  EXTENDED=""
fi

log=$(mktemp /tmp/pipebench-network-tests.XXXXXX)
"${PYTEST[@]}" -m "(network or waiting) $EXTENDED" --durations=10 "$@" >"$log" 2>&1 &
network=$!
trap 'kill -INT "$network" 2>/dev/null; wait "$network" 2>/dev/null; rm -f "$log"' EXIT
"${PYTEST[@]}" -x -m "not multiprocess and not network $EXTENDED" "$@"
set +e
"${PYTEST[@]}" -m "multiprocess and not network and not waiting $EXTENDED" --durations=15 "$@"
multi=$?
wait "$network"
net=$?
set -e
echo "---- the network and waiting tests (a pytest session of their own, run beside the others) ----"
cat "$log"
trap - EXIT
rm -f "$log"
# pytest exits 5 when a session selects no test (say, a path given with no network test in it)
for rc in "$multi" "$net"; do
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then exit "$rc"; fi
done
