#!/usr/bin/env bash
# Run 26, call 1: the Qwen3-8B-shaped DDTree round (budget 32, block 16, random weights) with the
# drafter in bf16 and with --draft-quantization fp8, alternating; the fp8 tiles' tests on the GPU;
# then the fp8 tiles' block sweep at a draft block's 16 rows (every drafter matrix, its LM head copy).
# Usage: OUT=dir LIMIT=s bash benchmarks/results/2026-12-02_h200_run26/call1.sh
set -uo pipefail
O=$(realpath -m "${OUT:-out}"); mkdir -p "$O"
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
step() {
  [ $((SECONDS + $2)) -gt ${LIMIT:-560} ] && { echo "$1: skipped (time)"; return; }
  local t0=$SECONDS; timeout $2 "${@:3}" > "$O/$1.log" 2>&1; echo "$1: rc $? in $((SECONDS - t0)) s"
}
round() {   # NAME [ARGS]: the phases tool on the Qwen3-8B shape's DDTree round
  step $1 150 python3 -m drafttree.bench.phases --random-weights qwen3-8b --batch 1 --prompt-len 512 \
    --max-model-len 2048 --iters 30 --tree-budgets "" --spec ddtree --budget 32 --block-size 16 \
    --out "$O/$1.json" "${@:2}"
  grep -A6 '"graph_ms"' "$O/$1.log"
}
round qwen_bf16
round qwen_fp8 --draft-quantization fp8
step tests_quant 120 python3 -m pytest -q -p no:cacheprovider tests/test_quant.py --durations=3
tail -n 3 "$O/tests_quant.log"; grep -h FAILED "$O/tests_quant.log" | head
step sweep_fp8 $((${LIMIT:-560} - SECONDS - 5)) python3 benchmarks/gemv_bench.py --shape qwen3-8b --fp8 --rows 16 \
  --only qkv,o,gate_up,down,lm_head,fc --block-n 64,128 --block-k 128,256 --warps 4 --stages 3 --splits 1,2,4 \
  --row-block 16 --prefetch 0 --out "$O/best_fp8.json"
grep -h "fastest\|torch ops\|rows, one" "$O/sweep_fp8.log"
