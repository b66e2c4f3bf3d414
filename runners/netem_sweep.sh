#!/usr/bin/env bash
# One job across network profiles, then the report.
#
#   runners/netem_sweep.sh [PROFILE...] [--out FILE] [--dry-run] [--hostfile HOSTS --iface IFACE] -- RUN_ARGS...
#
# PROFILE: a name (d10-1g), a 'delay 10ms bandwidth 1Gbps' string (quoted)
# or a matrix .json; default: the five seed profiles. RUN_ARGS: the run command's flags without
# --network/--out, e.g.  -- --system ours --model tiny --pp 2 --batch-size 4 --micro-batch-size 1
# Records go to results/netem_sweep.jsonl (default), the report next to it (.md).
# Locally the emulation needs root (the run command's virtual cluster); PYTHON=... picks the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."

profiles=() opts=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  case "$1" in
    -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --out|--hostfile|--iface|--nproc-per-node|--ssh-user|--plots|--remote-dir|--remote-python|--port)
      [ $# -ge 2 ] || { echo "netem_sweep.sh: $1 needs a value" >&2; exit 2; }
      opts+=("$1" "$2"); shift 2 ;;
    --dry-run|--no-report|--no-probe|--retry-failed|--sudo) opts+=("$1"); shift ;;
    -*) echo "netem_sweep.sh: unknown option $1 (run arguments go after --)" >&2; exit 2 ;;
    *) profiles+=("$1"); shift ;;
  esac
done
if [ "${1:-}" != "--" ] || [ $# -lt 2 ]; then
  echo "usage: runners/netem_sweep.sh [PROFILE...] [--out FILE] [--dry-run] -- RUN_ARGS..." >&2
  exit 2
fi
shift
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi
have_out=0
for o in ${opts[@]+"${opts[@]}"}; do [ "$o" = --out ] && have_out=1; done
[ $have_out = 1 ] || opts+=(--out results/netem_sweep.jsonl)
exec "$PY" -m runners.sweep --networks ${profiles[@]+"${profiles[@]}"} ${opts[@]+"${opts[@]}"} -- "$@"
