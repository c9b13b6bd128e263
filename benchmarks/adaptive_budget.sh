#!/usr/bin/env bash
# The measure table of "speculation that never loses": the default pair on HumanEval, plain
# decoding against the per-round budget choice (auto) and fixed budgets, for DFlash and DDTree,
# at T = 0 and 1, batch 1, 4 and 8. One results.json per batch under $OUT/b<batch>/ (each holds,
# per run, tokens/s, speedup over plain, τ, and the rounds per chosen budget), plus the cost
# model the engine measured (drafttree graphs --costs).
# Usage: OUT=dir NUM_PROMPTS=32 MAX_TOKENS=256 BATCHES="1 4 8" bash benchmarks/adaptive_budget.sh
# On a CPU: add EXTRA="--device cpu" and keep it short (NUM_PROMPTS=4 MAX_TOKENS=64 BATCHES=1).
set -euo pipefail
OUT=${OUT:-bench_adaptive}
NUM_PROMPTS=${NUM_PROMPTS:-32}
MAX_TOKENS=${MAX_TOKENS:-256}
BATCHES=${BATCHES:-"1 4 8"}
BUDGETS=${BUDGETS:-auto,4,8,16,32,64}
EXTRA=${EXTRA:-}
mkdir -p "$OUT"
drafttree graphs --costs --max-num-seqs 8 $EXTRA > "$OUT/cost_model.txt" 2>&1
for b in $BATCHES; do
  drafttree bench --prompts humaneval --num-prompts "$NUM_PROMPTS" --max-tokens "$MAX_TOKENS" \
    --methods ar,dflash,ddtree --budgets "$BUDGETS" --temperatures 0,1 --batch "$b" \
    --out "$OUT/b$b" $EXTRA 2>&1 | tail -n 30 > "$OUT/b$b.txt"
done
