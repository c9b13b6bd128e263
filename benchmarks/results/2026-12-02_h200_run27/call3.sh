#!/usr/bin/env bash
# Run 27, call 3: at f16 dots as the code's default, the fp8 GPU tests (graph replay against eager,
# Fp8Linear, the tiles), then the Qwen3-8B-shaped DDTree round with the bf16 and the fp8 drafter.
# Usage: OUT=dir LIMIT=s bash benchmarks/results/2026-12-02_h200_run27/call3.sh
set -uo pipefail
O=$(realpath -m "${OUT:-out}"); mkdir -p "$O"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
step() {
  [ $((SECONDS + $2)) -gt ${LIMIT:-560} ] && { echo "$1: skipped (time)"; return; }
  local t0=$SECONDS; timeout $2 "${@:3}" > "$O/$1.log" 2>&1; echo "$1: rc $? in $((SECONDS - t0)) s"
}
step tests_graphed 150 python3 -m pytest -q --tb=short -p no:cacheprovider tests/test_quant.py -k "graphed or linear"
grep -v "^  " "$O/tests_graphed.log" | tail -n 6
for q in fp8 bf16; do
  step qwen_$q 100 python3 -m drafttree.bench.phases --random-weights qwen3-8b --batch 1 --prompt-len 512 \
    --max-model-len 2048 --iters 30 --tree-budgets "" --spec ddtree --budget 32 --block-size 16 \
    $([ $q = fp8 ] && echo --draft-quantization fp8)
  grep -h -A5 '"graph_ms"' "$O/qwen_$q.log"
done
step tests_tiles $((${LIMIT:-560} - SECONDS - 5)) python3 -m pytest -q --tb=line -p no:cacheprovider tests/test_quant.py -k tiles
grep -v "^  " "$O/tests_tiles.log" | tail -n 6
cd "$O" && tar czf ../run27_call3.tgz . && rm -rf ./* && mv ../run27_call3.tgz .   # one file back
