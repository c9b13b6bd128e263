#!/usr/bin/env bash
# Run 15, call 3: the few-row projections with per-lane square sums, swept again at 33 rows; the DDTree
# round with each matrix at its fastest blocks where they beat the torch ops (else the torch ops)
# against DRAFTTREE_GEMM=0; then the CUDA-graph tests and the top-K tests call 1 did not reach.
# Usage: OUT=dir bash benchmarks/results/2026-11-30_h200_run15/call3.sh
set -uo pipefail
O=${OUT:-out}; mkdir -p "$O/logs"; L=$O/logs
export PYTHONPATH=.:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
timeout 150 python3 benchmarks/gemv_bench.py --rows 33 --block-n 64,128 --block-k 64,128 --warps 4 --stages 3 \
  --splits 1,2,4 --out "$L/best33.json" > "$L/gemm_bench_33.txt" 2>&1
grep -h "torch ops\|fastest\|one layer\|Error" "$L/gemm_bench_33.txt"; cat "$L/best33.json"; echo
round() {   # GEMM(0|1) NAME: the DDTree round, fused matrices at best33.json's blocks where they win
  DRAFTTREE_GEMM=$1 timeout 110 python3 -c "import json, sys, drafttree.models.gemm_kernel as g
best = json.load(open('$L/best33.json')) if __import__('os').path.exists('$L/best33.json') else []
for kind in g.BLOCKS:
    won = sorted(((1 << (n.bit_length() - 1), tuple(b)) for k, n, b, us, t in best if k == kind and us < t), reverse=True)
    g.BLOCKS[kind] = won + [(0, None)]
print('blocks', g.BLOCKS, file=sys.stderr)
from drafttree.bench.phases import main; sys.exit(main())" --batch 1 --prompt-len 512 --max-model-len 2048 \
    --iters 30 --random-weights qwen3-8b --tree-budgets "" --spec ddtree --budget 32 --block-size 16 \
    --out "$L/ddtree_$2.json" > "$L/ddtree_$2.txt" 2>&1
  echo "ddtree $2:"; grep -h 'blocks\|"decode"\|"round\|draft_and\|verify_acc\|Error' "$L/ddtree_$2.txt" | tail -5
}
round 1 1_gemm1; round 0 2_gemm0; round 1 3_gemm1
timeout 200 python3 -m pytest tests/test_cuda_graphs.py -q -p no:cacheprovider > "$L/test_cuda_graphs.log" 2>&1
echo "test_cuda_graphs: $(tail -n 1 "$L/test_cuda_graphs.log")"; grep -h "^FAILED" "$L/test_cuda_graphs.log"
timeout 80 python3 -m pytest tests/test_tree_kernel.py -q -p no:cacheprovider \
  -k "filtered_path or tied_group or at_its_capacity or feeds_the_tree" > "$L/test_topk.log" 2>&1
echo "test_tree_kernel (top-K rest): $(tail -n 1 "$L/test_topk.log")"; grep -h "^FAILED" "$L/test_topk.log"
tar czf "$O/logs.tgz" -C "$O" logs && rm -rf "$L"
