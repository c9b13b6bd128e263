#!/usr/bin/env bash
# Run 20, call 3 (carries the GGUF's first part; the machine of call 2 had been released): GPU tests of what changed (tiles, drafter
# attention) and of the overlapped rounds and CUDA graphs.
# Usage: OUT=dir bash benchmarks/results/2026-12-01_h200_run20/call3.sh   (after call2.sh)
set -uo pipefail
O=$(realpath -m "${OUT:-out}"); mkdir -p "$O"
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
rm -f /tmp/gguf.asm; cat .parts/g3.00 >> /tmp/gguf.asm; ls -la /tmp/gguf.asm
timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_gemv_kernel.py tests/test_attn_kernel.py \
  tests/test_overlap.py tests/test_cuda_graphs.py > "$O/tests.log" 2>&1
tail -n 1 "$O/tests.log"; grep -h "FAILED\|Error" "$O/tests.log" | head
