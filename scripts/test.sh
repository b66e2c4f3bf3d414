#!/usr/bin/env bash
# The test command: set up .venv (pinned dependencies), lint, and run the tests.
#   bash scripts/test.sh            what CI runs: ruff; then three pytest sessions side by side: the network
#                                   tests (root; skipped otherwise) with the multi-process tests marked waiting,
#                                   which mostly wait (on ssh, Slurm, emulated links, a hang, a timeout, a
#                                   signal); the multi-process tests (real torchrun ranks over gloo); and the
#                                   single-process tier, which stops at its first failure (and stops the
#                                   others). The other two sessions' output follows.
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

# Three pytest sessions at once, so that the cores are never idle: the network and waiting tests (mostly
# waiting on links, ssh, Slurm, hangs), the multi-process tests (real torchrun ranks) and the single-process
# tier in front, which stops at its first failure and then stops the other two.
netlog=$(mktemp /tmp/pipebench-network-tests.XXXXXX)
multilog=$(mktemp /tmp/pipebench-multiprocess-tests.XXXXXX)
"${PYTEST[@]}" -m "(network or waiting) $EXTENDED" --durations=10 "$@" >"$netlog" 2>&1 &
network=$!
"${PYTEST[@]}" -m "multiprocess and not network and not waiting $EXTENDED" --durations=15 "$@" >"$multilog" 2>&1 &
multi=$!
trap 'kill -INT "$network" "$multi" 2>/dev/null; wait "$network" "$multi" 2>/dev/null; rm -f "$netlog" "$multilog"' EXIT
"${PYTEST[@]}" -x -m "not multiprocess and not network $EXTENDED" "$@"
set +e
wait "$multi"
multi_rc=$?
wait "$network"
net_rc=$?
set -e
echo "---- the multi-process tests (a pytest session of their own, run beside the others) ----"
cat "$multilog"
echo "---- the network and waiting tests (a pytest session of their own, run beside the others) ----"
cat "$netlog"
trap - EXIT
rm -f "$netlog" "$multilog"
# pytest exits 5 when a session selects no test (say, a path given with no network test in it)
for rc in "$multi_rc" "$net_rc"; do
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then exit "$rc"; fi
done
