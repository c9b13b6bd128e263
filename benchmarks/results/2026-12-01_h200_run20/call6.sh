#!/usr/bin/env bash
# Run 20, call 6: after the drafter computes the block's own rope again where the torch ops run
# (a slice of the context's rope made call 5's dflash batch-8 capture fail): CUDA graphs and the
# drafter-attention tests on the GPU.
# Usage: OUT=dir bash benchmarks/results/2026-12-01_h200_run20/call6.sh
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
timeout 200 python3 -m pytest -q -p no:cacheprovider -rf tests/test_cuda_graphs.py tests/test_attn_kernel.py -k "not matches_softmax" > "$OUT/tests.log" 2>&1
tail -n 3 "$OUT/tests.log"; grep -h "FAILED\|Error" "$OUT/tests.log" | head
