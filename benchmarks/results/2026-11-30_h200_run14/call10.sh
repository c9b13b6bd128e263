#!/usr/bin/env bash
# Run 14, call 10: the CUDA-graph tests and the decode step with SiLU·up in the gate/up epilogue and
# the blocks of call 9's sweeps in gemv_kernel.BLOCKS. Usage: OUT=dir bash .../call10.sh
set -uo pipefail
O=${OUT:-out}; mkdir -p "$O"
export PYTHONPATH=.:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
timeout 100 python3 -m drafttree.bench.phases --batch 1 --prompt-len 512 --max-model-len 2048 --iters 30 \
  --random-weights qwen3-8b --spec none --tree-budgets "" --out "$O/decode.json" > "$O/decode.txt" 2>&1
echo "decode: $(grep -h '"decode"' "$O/decode.txt" | tail -1)"
timeout 170 python3 -m pytest tests/test_cuda_graphs.py -q -p no:cacheprovider > "$O/test_cuda_graphs.log" 2>&1
echo "test_cuda_graphs: $(tail -n 1 "$O/test_cuda_graphs.log")"; grep -h "^FAILED" "$O/test_cuda_graphs.log"
