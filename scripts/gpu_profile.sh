#!/usr/bin/env bash
# Profile this machine's GPU for the compute model (tools/gpu_profile.py): the GEMM, attention and layer
# grids at GPT-3 XL, 2.7B, 6.7B and 13B widths in fp32/bf16/fp16, every system at one rank, the device
# file's GEMM curve fitted from them (workload/devices) and a page of tables (results/measured-here/
# gpu-profile-<gpu>.md), in at most 8 minutes. Without a GPU it says so in one line and exits 0.
#   bash scripts/gpu_profile.sh [--budget-s 480] [--only gemm|attention|layer|systems]... [--out-dir DIR]
#                               [--device-file NAME] [--no-write-device]
exec bash "$(dirname "$0")/tool.sh" gpu_profile "$@"
