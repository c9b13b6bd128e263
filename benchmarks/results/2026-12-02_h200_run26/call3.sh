#!/usr/bin/env bash
# Run 26, call 3: at the code's fp8 blocks (from calls 1-2), the Qwen3-8B-shaped DDTree round with
# the bf16 and the fp8 drafter, alternating; the fp8 tests on the GPU (tiles, graphs vs eager);
# then the top-k / top-p threshold kernel stage (its tests, filter_bench on randn and peaked logits).
# Usage: OUT=dir LIMIT=s bash benchmarks/results/2026-12-02_h200_run26/call3.sh
set -uo pipefail
O=$(realpath -m "${OUT:-out}"); mkdir -p "$O"
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
step() {
  [ $((SECONDS + $2)) -gt ${LIMIT:-560} ] && { echo "$1: skipped (time)"; return; }
  local t0=$SECONDS; timeout $2 "${@:3}" > "$O/$1.log" 2>&1; echo "$1: rc $? in $((SECONDS - t0)) s"
}
for q in fp8 bf16; do
  step qwen_${q}_$SECONDS 100 python3 -m drafttree.bench.phases --random-weights qwen3-8b --batch 1 --prompt-len 512 \
    --max-model-len 2048 --iters 30 --tree-budgets "" --spec ddtree --budget 32 --block-size 16 \
    $([ $q = fp8 ] && echo --draft-quantization fp8)
done
grep -h -A5 '"graph_ms"' "$O"/qwen_*.log
step tests_quant 130 python3 -m pytest -q --tb=short -p no:cacheprovider tests/test_quant.py --durations=3
grep -v "^  " "$O/tests_quant.log" | grep -v DEBUG | tail -n 12
mkdir -p "$O/filter"
OUT="$O/filter" timeout $((${LIMIT:-560} - SECONDS - 5)) bash benchmarks/h200_checks.sh filter > "$O/filter.txt" 2>&1
tail -n 40 "$O/filter.txt"
cd "$O" && tar czf ../run26_call3.tgz . && rm -rf ./* && mv ../run26_call3.tgz .   # one file back
