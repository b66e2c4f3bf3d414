#!/usr/bin/env bash
# The test command: set up .venv (pinned dependencies) and run the whole test suite.
# Multi-process tests start real torchrun ranks over gloo; network tests need root (skipped otherwise).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m pytest -q "$@"
