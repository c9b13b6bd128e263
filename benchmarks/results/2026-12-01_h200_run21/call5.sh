#!/usr/bin/env bash
# Run 21, calls 5 and 6 (as typed inline, on call 4's machine while warm): more DDTree round
# costs of the SmolLM2-135M shape by budget. Call 5: BUDGETS="23 31 32 15" LIMIT=175;
# call 6: BUDGETS="32 31" LIMIT=70 TIMEOUT=35.
# Usage: OUT=dir BUDGETS="23 31 32 15" bash benchmarks/results/2026-12-01_h200_run21/call5.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache PYTHONPATH=$PWD
P="--batch 1 --prompt-len 512 --max-model-len 2048 --iters 30 --tree-budgets"
for b in ${BUDGETS:-23 31 32 15}; do
  [ $((SECONDS + 45)) -gt ${LIMIT:-175} ] && { echo "b$b: skipped"; continue; }
  timeout ${TIMEOUT:-50} python3 -m drafttree.bench.phases $P "" --random-weights smollm2-135m --spec ddtree \
    --budget $b --block-size 16 --out $OUT/b${b}.json > $OUT/b${b}.txt 2>&1
  echo "b$b ($SECONDS s): $(grep -h '"draft_and\|"verify_acc\|"round"\|Error' $OUT/b${b}.txt | tail -3 | tr -s ' \n' ' ')"
done
