#!/usr/bin/env bash
# Run 17, call 8: GPU tests at the code's new few-row blocks (tiles for weights under 2^22
# elements, token rows per program): the projections against the torch ops, graphs against
# eager, PDL against none, and fp32 speculation against plain decoding through the code's blocks.
# Usage: OUT=dir bash benchmarks/results/2026-12-01_h200_run17/call8.sh
set -uo pipefail
O=${OUT:-out}; mkdir -p "$O"
export PYTHONPATH=.:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
timeout 150 python3 -m pytest -q tests/test_gemv_kernel.py -k "rows or prologue or classes" > "$O/test_gemv_kernel.log" 2>&1
tail -2 "$O/test_gemv_kernel.log"
timeout 250 python3 -m pytest -q tests/test_cuda_graphs.py > "$O/test_cuda_graphs.log" 2>&1
tail -2 "$O/test_cuda_graphs.log"; grep -h "FAILED\|Error" "$O"/*.log | head -20
