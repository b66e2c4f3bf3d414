#!/usr/bin/env bash
# The whole comparison.
#
#   runners/run_all.sh                      # local default: set up .venv, run runners/sweeps/local.toml
#                                           # on this machine, report into results/local.md (+ results/plots)
#   runners/run_all.sh --hostfile HOSTS [--iface eth0] [--sweep FILE] [--nproc-per-node N] [--ssh-user USER]
#                                           # the cluster: every run across the hosts over ssh, netem on each
#                                           # node's interface (default sweep: runners/sweeps/gpt3-xl-cluster.toml)
#
# Other options go to the sweep (python -m runners.sweep --help): --dry-run, --only SYSTEM, --out FILE,
# --retry-failed, --sudo, --remote-dir DIR, --remote-python PY, --port N.
# PYTHON=/path/to/python skips the environment set-up and uses that interpreter.
# A sweep that is run again skips the runs already in its record file.
set -euo pipefail
cd "$(dirname "$0")/.."

hostfile="" sweep="" cluster_args=() extra=()
usage() { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; }
need() { [ $# -ge 2 ] || { echo "run_all.sh: $1 needs a value" >&2; exit 2; }; }
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --hostfile) need "$@"; hostfile=$2; shift 2 ;;
    --sweep) need "$@"; sweep=$2; shift 2 ;;
    --iface|--nproc-per-node|--ssh-user) need "$@"; cluster_args+=("$1" "$2"); shift 2 ;;
    *) extra+=("$1"); shift ;;
  esac
done

if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
else
  bash scripts/setup_env.sh
  PY=.venv/bin/python
fi

status=0
if [ -z "$hostfile" ]; then
  [ ${#cluster_args[@]} -eq 0 ] || { echo "run_all.sh: ${cluster_args[0]} needs --hostfile" >&2; exit 2; }
  sweep=${sweep:-runners/sweeps/local.toml}
  if [ "$(id -u)" != 0 ]; then
    echo "run_all.sh: not root: the runs under emulated networks (network namespaces, tc) will be skipped;" \
         "run as root for the network experiment" >&2
  fi
  "$PY" -m runners.sweep "$sweep" --plots results/plots ${extra[@]+"${extra[@]}"} || status=$?
else
  sweep=${sweep:-runners/sweeps/gpt3-xl-cluster.toml}
  "$PY" -m runners.sweep "$sweep" --hostfile "$hostfile" --plots results/plots \
    ${cluster_args[@]+"${cluster_args[@]}"} ${extra[@]+"${extra[@]}"} || status=$?
fi
exit $status
