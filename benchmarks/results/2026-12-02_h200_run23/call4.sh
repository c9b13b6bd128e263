#!/usr/bin/env bash
# Run 23, call 4 (after call 3, same machine): the default pair at budget 31, HumanEval, 256 tokens,
# 32 prompts: batch 1 (plain, DDTree with the shipped drafter and with call 3's, alternating), batch 4,
# and T = 1 (16 prompts) for both drafters.
# Usage: OUT=dir bash benchmarks/results/2026-12-02_h200_run23/call4.sh
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
N=/tmp/train1/drafter
bench b1_shipped 150 --methods ar,ddtree --budgets 31
bench b1_new 60 --methods ddtree --budgets 31 --draft-model $N
bench b1_new_2 60 --methods ddtree,ar --budgets 31 --draft-model $N
bench b4 90 --batch 4 --methods ar,ddtree --budgets 31 --draft-model $N
bench b4_shipped 60 --batch 4 --methods ddtree --budgets 31
bench t1_new 60 --methods ddtree --budgets 31 --temperatures 1 --num-prompts 16 --draft-model $N
bench t1_shipped 60 --methods ddtree --budgets 31 --temperatures 1 --num-prompts 16
tar czf "$O/logs.tgz" -C "$O" logs && rm -rf "$L"
