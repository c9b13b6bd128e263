#!/usr/bin/env bash
# Run 22, call 4 (after call 3, same machine): the default pair at budget 31, HumanEval, T = 0,
# 256 tokens, 32 prompts, batch 1: plain and DDTree with the shipped drafter, DDTree with call 3's
# drafter (/tmp/train1/drafter), alternating; then batch 4.
# Usage: OUT=dir bash benchmarks/results/2026-12-01_h200_run22/call4.sh
set -uo pipefail
O=$(realpath -m "${OUT:-out}"); mkdir -p "$O/logs"; L=$O/logs
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
B="python3 -m drafttree.cli bench --prompts humaneval --max-tokens 256 --temperatures 0 --num-prompts 32"
bench() {   # name, seconds, bench args
  [ $((SECONDS + $2)) -gt ${LIMIT:-360} ] && { echo "$1: skipped (time)"; return; }
  timeout $2 $B ${@:3} --out "$L/$1" > "$L/$1.log" 2>&1
  echo "$1:"; grep -hv "bench:\|capturing\|transformers\|wrote" "$L/$1.log" | tail -n 3
}
bench b1_shipped 150 --methods ar,ddtree --budgets 31
bench b1_new 70 --methods ddtree --budgets 31 --draft-model /tmp/train1/drafter
bench b1_shipped_2 70 --methods ar,ddtree --budgets 31
bench b4_new 70 --batch 4 --methods ar,ddtree --budgets 31 --draft-model /tmp/train1/drafter
tar czf "$O/logs.tgz" -C "$O" logs && rm -rf "$L"
