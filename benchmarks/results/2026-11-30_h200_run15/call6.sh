#!/usr/bin/env bash
# Run 15, last call: the attention kernel tests and the fused-projection tests at the read-through
# mends (attn_kernel._roped, gemm_kernel.outputs). Usage: OUT=dir bash .../call6.sh
set -uo pipefail
O=${OUT:-out}
export PYTHONPATH=.:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
timeout 110 python3 -m pytest tests/test_attn_kernel.py -q -p no:cacheprovider > "$O/test_attn_kernel.log" 2>&1
echo "test_attn_kernel: $(tail -n 1 "$O/test_attn_kernel.log")"; grep -h "^FAILED" "$O/test_attn_kernel.log"
timeout 80 python3 -m pytest tests/test_gemv_kernel.py -q -p no:cacheprovider -k "1row or 33rows" > "$O/test_gemv_kernel.log" 2>&1
echo "test_gemv_kernel: $(tail -n 1 "$O/test_gemv_kernel.log")"; grep -h "^FAILED" "$O/test_gemv_kernel.log"
