#!/usr/bin/env bash
# Run 15, call 1: the GPU tests at 19ea4f3 (whose shared rope and key functions had run on the CPU
# only), the decode step, the DDTree round, the tree build and the cuBLAS projections at 16/33 rows.
# Usage: OUT=dir bash benchmarks/results/2026-11-30_h200_run15/call1.sh
set -uo pipefail
O=${OUT:-out}; mkdir -p "$O/logs"; L=$O/logs
export PYTHONPATH=.:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
git rev-parse --short HEAD > "$O/commit.txt" 2>/dev/null
P="--batch 1 --prompt-len 512 --max-model-len 2048 --iters 30 --random-weights qwen3-8b"
timeout 100 python3 -m drafttree.bench.phases $P --spec none --tree-budgets "" --out "$L/decode.json" > "$L/decode.txt" 2>&1
echo "decode: $(grep -h '"decode"' "$L/decode.txt" | tail -1)"
timeout 120 python3 -m drafttree.bench.phases $P --spec ddtree --budget 32 --block-size 16 --tree-budgets "" \
  --out "$L/ddtree.json" > "$L/ddtree.txt" 2>&1
echo "ddtree:"; grep -h '"decode"\|"round\|draft_and\|verify_acc' "$L/ddtree.txt" | tail -4
timeout 60 python3 benchmarks/tree_build_bench.py --budgets 32,128 --logits gaussian > "$L/tree_build_bench.txt" 2>&1
tail -n 6 "$L/tree_build_bench.txt"
timeout 60 python3 benchmarks/verify_gemm_bench.py --rows 1,16,33,64 > "$L/verify_gemm_bench.txt" 2>&1
cat "$L/verify_gemm_bench.txt"
timeout 250 python3 -m pytest tests/test_attn_kernel.py tests/test_tree_kernel.py tests/test_cuda_graphs.py \
  tests/test_gemv_kernel.py -q -p no:cacheprovider > "$L/tests.log" 2>&1
echo "tests: $(tail -n 1 "$L/tests.log")"; grep -h "^FAILED" "$L/tests.log"
tar czf "$O/logs.tgz" -C "$O" logs && rm -rf "$L"
