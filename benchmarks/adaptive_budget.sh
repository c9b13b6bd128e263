#!/usr/bin/env bash
# The measure table of "speculation that never loses": the default pair, plain decoding against
# the per-round budget choice (auto) and fixed budgets, for DFlash and DDTree, at T = 0 and 1, on
# each prompt set at each batch size. One engine per (method, budget) runs every cell; results.json
# holds, per cell and run, tokens/s, speedup over plain, τ, and the rounds per chosen budget. The
# cost model the engine measured goes to cost_model.txt (drafttree graphs --costs).
# Usage: OUT=dir PROMPTS=humaneval,sharegpt-heldout NUM_PROMPTS=32 MAX_TOKENS=256 BATCHES=1,4,16,64 \
#        bash benchmarks/adaptive_budget.sh
# On a CPU: add EXTRA="--device cpu" and keep it short (NUM_PROMPTS=4 MAX_TOKENS=64 BATCHES=1).
set -euo pipefail
OUT=${OUT:-bench_adaptive}
PROMPTS=${PROMPTS:-humaneval,sharegpt-heldout}
NUM_PROMPTS=${NUM_PROMPTS:-32}
MAX_TOKENS=${MAX_TOKENS:-256}
BATCHES=${BATCHES:-1,4,16,64}
BUDGETS=${BUDGETS:-auto,4,8,16,32,64}
EXTRA=${EXTRA:-}
mkdir -p "$OUT"
largest=$(tr ',' '\n' <<< "$BATCHES" | sort -n | tail -1)
python3 -m drafttree.cli graphs --costs --max-num-seqs "$largest" $EXTRA > "$OUT/cost_model.txt" 2>&1 || true
python3 -m drafttree.cli bench --prompts "$PROMPTS" --num-prompts "$NUM_PROMPTS" --max-tokens "$MAX_TOKENS" \
  --methods ar,dflash,ddtree --budgets "$BUDGETS" --temperatures 0,1 --batch "$BATCHES" \
  --out "$OUT" $EXTRA 2>&1 | grep -v "^bench:" | tail -n 80
