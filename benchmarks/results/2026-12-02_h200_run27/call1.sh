#!/usr/bin/env bash
# Run 27, call 1: the fp8 tiles' ways of multiplying (gemm_kernel.FP8_DOTS: "widen" e4m3 to bf16,
# "f16" dots, "fp8" e4m3 x e4m3 dots with the inputs scaled per token row and step). Their GPU
# tests; a block sweep of "f16" and "fp8" at a draft block's 16 rows over the Qwen3-8B drafter's
# matrices; then the Qwen3-8B-shaped DDTree round with the fp8 drafter in each way at its sweep's
# fastest blocks, and with the bf16 drafter.
# Usage: OUT=dir LIMIT=s bash benchmarks/results/2026-12-02_h200_run27/call1.sh
set -uo pipefail
O=$(realpath -m "${OUT:-out}"); mkdir -p "$O"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
step() {
  [ $((SECONDS + $2)) -gt ${LIMIT:-560} ] && { echo "$1: skipped (time)"; return; }
  local t0=$SECONDS; timeout $2 "${@:3}" > "$O/$1.log" 2>&1; echo "$1: rc $? in $((SECONDS - t0)) s"
}
step tests_quant 110 python3 -m pytest -q --tb=line -p no:cacheprovider tests/test_quant.py -k "tiles or linear"
grep -v "^  " "$O/tests_quant.log" | tail -n 8
for dot in fp8 f16; do
  DRAFTTREE_FP8_DOT=$dot step sweep_$dot 110 python3 benchmarks/gemv_bench.py --shape qwen3-8b --fp8 --rows 16 \
    --only qkv,o,gate_up,down,lm_head,fc --block-n 64,128 --block-k $([ $dot = fp8 ] && echo 128,256 || echo 128) \
    --warps 4 --stages 3 --splits 1,2,4 --row-block 16 --prefetch 0 --out "$O/best_$dot.json"
  grep -h "fastest\|torch ops\|rows, one" "$O/sweep_$dot.log"
done
round() {   # NAME BEST.json [ARGS]: the Qwen3-8B DDTree round, the fp8 tiles at BEST's blocks
  step $1 100 python3 -c "import json, os, sys
from drafttree.models import gemm_kernel as g
for kind, numel, blocks, us, _ in json.load(open('$2')) if os.path.exists('$2') else []:
    g.set_blocks(kind, numel, tuple(blocks), split=True, table=g.BLOCKS_FP8)
print(g.FP8_DOT, g.BLOCKS_FP8)
from drafttree.bench.phases import main; sys.exit(main())" --random-weights qwen3-8b --batch 1 --prompt-len 512 \
    --max-model-len 2048 --iters 30 --tree-budgets "" --spec ddtree --budget 32 --block-size 16 "${@:3}"
  grep -h -A5 '"graph_ms"' "$O/$1.log"
}
DRAFTTREE_FP8_DOT=fp8 round qwen_fp8dot "$O/best_fp8.json" --draft-quantization fp8
round qwen_bf16 none
DRAFTTREE_FP8_DOT=f16 round qwen_f16dot "$O/best_f16.json" --draft-quantization fp8
cd "$O" && tar czf ../run27_call1.tgz . && rm -rf ./* && mv ../run27_call1.tgz .   # one file back
