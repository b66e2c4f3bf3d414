#!/usr/bin/env bash
# Run one of the tools (python -m tools.NAME ARGS) with the suite's interpreter: .venv/bin/python
# (scripts/setup_env.sh; on a machine with a torch of its own, setup_env.sh --use-system-torch), else
# $PYTHON or python3.   bash scripts/tool.sh NAME [ARGS...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
name=${1:?usage: scripts/tool.sh NAME [ARGS...]}
shift
exec "$PY" -m "tools.$name" "$@"
