#!/usr/bin/env bash
# Run 21, call 1: the GPU tests first. test_cuda_graphs.py checks the capture fix (graph runners
# hold the model runner weakly, captures pause the cyclic collector); then the overlap tests and
# the fused / tree / tree-kernel files whole.
# Usage: OUT=dir bash benchmarks/results/2026-12-01_h200_run21/call1.sh
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/machine.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/machine.txt"
timeout 200 python3 -m pytest -q -p no:cacheprovider -rf tests/test_cuda_graphs.py > "$OUT/graphs.log" 2>&1
tail -n 2 "$OUT/graphs.log"; grep -c "CUDAGraph::reset" "$OUT/graphs.log"
left=$((570 - SECONDS)); echo "overlap with ${left}s left"
timeout $((left < 130 ? left : 130)) python3 -m pytest -q -p no:cacheprovider -rf tests/test_overlap.py > "$OUT/overlap.log" 2>&1
tail -n 2 "$OUT/overlap.log"
left=$((575 - SECONDS)); echo "fused/tree with ${left}s left"
timeout $left python3 -m pytest -q -p no:cacheprovider -rf tests/test_fused.py tests/test_tree.py tests/test_tree_kernel.py > "$OUT/rest.log" 2>&1
tail -n 3 "$OUT/rest.log"; grep -h "FAILED" "$OUT"/*.log | head
