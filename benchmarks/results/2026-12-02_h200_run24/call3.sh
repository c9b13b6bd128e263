#!/usr/bin/env bash
# Run 24, call 3 (after call 2, same machine; the drafter travels again): the default pair,
# HumanEval, 256 tokens, budget 31. T = 1 at batch 1 (16 prompts): plain decoding, DDTree speculating
# on sampled rounds, DDTree decoding them plainly (the shipped config); T = 0 at batch 8 and at batch 16 speculating (the shipped schedule decodes 16 rows plainly).
# Capture time per bench process is in its log (the progress bar).
# Usage: OUT=dir LIMIT=s bash benchmarks/results/2026-12-02_h200_run24/call3.sh
set -uo pipefail
O=$(realpath -m "${OUT:-out}"); mkdir -p "$O/logs"; L=$O/logs
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
B="python3 -m drafttree.cli bench --prompts humaneval --max-tokens 256 --budgets 31"
bench() {   # name, seconds, bench args
  [ $((SECONDS + $2)) -gt ${LIMIT:-500} ] && { echo "$1: skipped (time)"; return; }
  local t0=$SECONDS; timeout $2 $B ${@:3} --out "$L/$1" > "$L/$1.log" 2>&1
  echo "$1: rc $? in $((SECONDS - t0)) s"
  tr '\r' '\n' < "$L/$1.log" | grep -v "bench:\|transformers\|wrote" | grep "100%\|^method\|^ar\|^dd\|^df\|rror" | tail -n 6
  grep -ho '"graph_fallbacks": [^,}]*' "$L/$1/results.json" 2>/dev/null | sort | uniq -c
}
bench t1 120 --temperatures 1 --num-prompts 16 --methods ar,ddtree --speculate-sampled
bench t1_plainly 70 --temperatures 1 --num-prompts 16 --methods ddtree --no-speculate-sampled
bench b8 100 --temperatures 0 --num-prompts 64 --batch 8 --methods ar,ddtree
bench b16 100 --temperatures 0 --num-prompts 64 --batch 16 --methods ar,ddtree --budget-schedule 64:0
bench t07 80 --temperatures 0.7 --num-prompts 16 --methods ar,ddtree --speculate-sampled
tar czf "$O/logs.tgz" -C "$O" logs && rm -rf "$L"
