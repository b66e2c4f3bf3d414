#!/usr/bin/env bash
# The checks that prove the CUDA path on one machine with one GPU; each check one line of a markdown
# summary (results/measured-here/gpu-check-<gpu>.md). Without a GPU it says so and exits 0.
#   bash scripts/gpu_check.sh [--out FILE.md] [--only environment|one-rank|shared|shaped|figures]... [--steps N]
#                             [--device cpu]     (the same checks on CPU over gloo: a rehearsal of the script)
# It runs with the torch, fairscale and megatron-core it finds: .venv/bin/python (scripts/setup_env.sh; on a
# machine with a torch of its own, setup_env.sh --use-system-torch [--wheels DIR]), else $PYTHON or python3.
# The checks over virtual nodes (shared, shaped, figures) need root and sshd. See tools/gpu_check.py.
exec bash "$(dirname "$0")/tool.sh" gpu_check "$@"
