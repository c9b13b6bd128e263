#!/usr/bin/env bash
# Run 20, call 5: tests/test_cuda_graphs.py on the GPU after its bf16 case got 8-field blocks
# (call 3 ran out of time after that case's 3 failures, an unpacking error).
# Usage: OUT=dir bash benchmarks/results/2026-12-01_h200_run20/call5.sh
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
timeout 320 python3 -m pytest -q -p no:cacheprovider -rf tests/test_cuda_graphs.py > "$OUT/tests.log" 2>&1
tail -n 3 "$OUT/tests.log"; grep -h "FAILED\|Error" "$OUT/tests.log" | head
