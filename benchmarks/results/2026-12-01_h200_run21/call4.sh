#!/usr/bin/env bash
# Run 21, call 4: what a DDTree round of the SmolLM2-135M shape costs at other budgets (block 16,
# batch 1): verify rows 33 (B = 32) take three 16-row programs per weight tile, the third with one
# row; 32 rows (B = 31) two; B = 15 one. B = 47 (48 rows) with the code's blocks extended to 48
# rows (rows48.json; the code stops the tiles at 33 rows and runs cuBLAS past them) and without.
# Usage: OUT=dir bash benchmarks/results/2026-12-01_h200_run21/call4.sh
set -uo pipefail
O=$(realpath -m "${OUT:-out}"); mkdir -p "$O/logs"; L=$O/logs
export PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
P="--batch 1 --prompt-len 512 --max-model-len 2048 --iters 30 --tree-budgets"
phases() {   # name, budget, seconds, extra env (skipped where it could end past 450 s)
  [ $((SECONDS + $3)) -gt 450 ] && { echo "$1: skipped (time)"; return; }
  env ${4:-} timeout $3 python3 -m drafttree.bench.phases $P "" --random-weights smollm2-135m \
    --spec ddtree --budget $2 --block-size 16 --out "$L/$1.json" > "$L/$1.txt" 2>&1
  echo "$1: $(grep -h '"draft_and\|"verify_acc\|"round"\|Error\|failed' "$L/$1.txt" | tail -3 | tr -s ' \n' ' ')"
}
phases b32_1 32 150
phases b31_1 31 60
phases b15_1 15 60
phases b47_rows48 47 60 DRAFTTREE_BLOCKS=benchmarks/results/2026-12-01_h200_run21/rows48.json
phases b47_code 47 60
phases b32_2 32 50
phases b31_2 31 50
tar czf "$O/logs.tgz" -C "$O" logs && rm -rf "$L"
