#!/usr/bin/env bash
# Run 19, call 2: the GGUF's second part; GPU tests at the head: CUDA graphs (whole file),
# the compiled pieces, the tree.
# Usage: OUT=dir bash benchmarks/results/2026-12-01_h200_run19/call2.sh
set -uo pipefail
O=$(realpath -m "${OUT:-out}"); mkdir -p "$O"
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
cat .parts/g3.01 >> /tmp/gguf.asm
timeout 260 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py > "$O/test_cuda_graphs.log" 2>&1
tail -n 1 "$O/test_cuda_graphs.log"; grep -h "FAILED\|Error" "$O/test_cuda_graphs.log" | head
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_fused.py tests/test_tree.py tests/test_tree_kernel.py > "$O/test_pieces.log" 2>&1
tail -n 1 "$O/test_pieces.log"; grep -h "FAILED\|Error" "$O/test_pieces.log" | head
