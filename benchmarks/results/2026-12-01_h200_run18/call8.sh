#!/usr/bin/env bash
# Run 18, call 8 (the final head): the GGUF's first part; graphs against eager and fp32
# speculation against plain decoding through the code's blocks (the tests a kernel table touches).
# Usage: OUT=dir bash benchmarks/results/2026-12-01_h200_run18/call8.sh
set -uo pipefail
O=${OUT:-out}; mkdir -p "$O"
export PYTHONPATH=.:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
rm -f /tmp/gguf.asm; cat .parts/g3.00 >> /tmp/gguf.asm
timeout 100 python3 -m pytest -q tests/test_cuda_graphs.py -k "fused or dependent or code_blocks or first_request_graphed" \
  > "$O/test_cuda_graphs.log" 2>&1
tail -n 1 "$O/test_cuda_graphs.log"; grep -h "FAILED\|Error" "$O/test_cuda_graphs.log" | head
