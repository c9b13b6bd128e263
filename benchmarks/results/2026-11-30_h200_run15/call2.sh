#!/usr/bin/env bash
# Run 15, call 2: the few-row tensor-core projections (models/gemm_kernel.py): their GPU tests (the
# bf16 many-row cases), a block sweep per Qwen3-8B matrix at 33 and 16 rows against the torch ops,
# and the DDTree round and DFlash round with them (DRAFTTREE_GEMM=1) and without (=0), alternating.
# Usage: OUT=dir bash benchmarks/results/2026-11-30_h200_run15/call2.sh
set -uo pipefail
O=${OUT:-out}; mkdir -p "$O/logs"; L=$O/logs
export PYTHONPATH=.:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
timeout 120 python3 -m pytest tests/test_gemv_kernel.py -q -p no:cacheprovider > "$L/test_gemv_kernel.log" 2>&1
echo "test_gemv_kernel: $(tail -n 1 "$L/test_gemv_kernel.log")"; grep -h "^FAILED\|Error" "$L/test_gemv_kernel.log" | head -5
timeout 200 python3 benchmarks/gemv_bench.py --rows 33 --block-n 32,64,128 --block-k 64,128 --warps 4 \
  --stages 3 --splits 1,2,4 --out "$L/best33.json" > "$L/gemm_bench_33.txt" 2>&1
grep -h "torch ops\|fastest\|one layer\|Error" "$L/gemm_bench_33.txt"
timeout 90 python3 benchmarks/gemv_bench.py --rows 16 --block-n 64,128 --block-k 128 --warps 4 \
  --stages 3 --splits 1,2,4 --out "$L/best16.json" > "$L/gemm_bench_16.txt" 2>&1
grep -h "torch ops\|fastest\|one layer\|Error" "$L/gemm_bench_16.txt"
i=0
for g in 1 0 1; do
  i=$((i + 1))
  DRAFTTREE_GEMM=$g timeout 120 python3 -m drafttree.bench.phases --batch 1 --prompt-len 512 --max-model-len 2048 \
    --iters 30 --random-weights qwen3-8b --tree-budgets "" --spec ddtree --budget 32 --block-size 16 \
    --out "$L/ddtree_${i}_gemm$g.json" > "$L/ddtree_${i}_gemm$g.txt" 2>&1
  echo "ddtree GEMM=$g:"; grep -h '"decode"\|"round\|draft_and\|verify_acc\|Error' "$L/ddtree_${i}_gemm$g.txt" | tail -4
done
tar czf "$O/logs.tgz" -C "$O" logs && rm -rf "$L"
