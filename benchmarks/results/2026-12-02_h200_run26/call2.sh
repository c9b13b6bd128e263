#!/usr/bin/env bash
# Run 26, call 2: the fp8 tiles' kernel tests on the GPU (stop at the first failure, tracebacks);
# a block sweep of the fp8 tiles with the token rows as the MMA's M (DRAFTTREE_FP8_TOKEN_ROWS_M=1,
# the weights widened as its B) at 16 rows; then the Qwen3-8B-shaped DDTree round: bf16 drafter,
# fp8 drafter with token rows as M at this sweep's fastest blocks, fp8 with weight rows as M at
# call 1's fastest blocks.
# Usage: OUT=dir LIMIT=s bash benchmarks/results/2026-12-02_h200_run26/call2.sh
set -uo pipefail
O=$(realpath -m "${OUT:-out}"); mkdir -p "$O"
R=benchmarks/results/2026-12-02_h200_run26
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
step() {
  [ $((SECONDS + $2)) -gt ${LIMIT:-560} ] && { echo "$1: skipped (time)"; return; }
  local t0=$SECONDS; timeout $2 "${@:3}" > "$O/$1.log" 2>&1; echo "$1: rc $? in $((SECONDS - t0)) s"
}
step tests_quant 100 python3 -m pytest -x -q --tb=short -p no:cacheprovider tests/test_quant.py -k "tiles or linear"
grep -v "^  " "$O/tests_quant.log" | tail -n 25
DRAFTTREE_FP8_TOKEN_ROWS_M=1 step sweep_tokm 120 python3 benchmarks/gemv_bench.py --shape qwen3-8b --fp8 --rows 16 \
  --only qkv,gate_up,down,lm_head --block-n 32,64,128 --block-k 64,128 --warps 4 --stages 3 --splits 2,4 \
  --row-block 16 --prefetch 0 --out "$O/best_tokm.json"
grep -h "fastest\|rows, one" "$O/sweep_tokm.log"
round() {   # NAME BEST.json [ARGS]: the Qwen3-8B DDTree round, the fp8 tiles at BEST's blocks
  step $1 110 python3 -c "import json, os, sys
from drafttree.models import gemm_kernel as g
for kind, numel, blocks, us, _ in json.load(open('$2')) if os.path.exists('$2') else []:
    g.set_blocks(kind, numel, tuple(blocks), split=True, table=g.BLOCKS_FP8)
print(g.BLOCKS_FP8)
from drafttree.bench.phases import main; sys.exit(main())" --random-weights qwen3-8b --batch 1 --prompt-len 512 \
    --max-model-len 2048 --iters 30 --tree-budgets "" --spec ddtree --budget 32 --block-size 16 "${@:3}"
  grep -A5 '"graph_ms"' "$O/$1.log"
}
round qwen_bf16 none
DRAFTTREE_FP8_TOKEN_ROWS_M=1 round qwen_fp8_tokm "$O/best_tokm.json" --draft-quantization fp8
DRAFTTREE_FP8_TOKEN_ROWS_M=0 round qwen_fp8_wm $R/1_413ace5_fp8_drafter/best_fp8.json --draft-quantization fp8
