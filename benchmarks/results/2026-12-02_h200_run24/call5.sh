#!/usr/bin/env bash
# Run 24, call 5 (a fresh machine; random weights): call 4 again with the decode step's feature
# append as one compiled piece (three to five small launches before), and the GPU tests of the
# drafter's cache after decode rounds against a prefill's (graphed, compiled).
# Usage: OUT=dir LIMIT=s bash benchmarks/results/2026-12-02_h200_run24/call5.sh
set -uo pipefail
O=$(realpath -m "${OUT:-out}"); mkdir -p "$O"
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
step() {
  [ $((SECONDS + $2)) -gt ${LIMIT:-500} ] && { echo "$1: skipped (time)"; return; }
  local t0=$SECONDS; timeout $2 "${@:3}" > "$O/$1.log" 2>&1; echo "$1: rc $? in $((SECONDS - t0)) s"
}
B="python3 -m drafttree.cli bench --random-weights smollm2-135m --max-tokens 128"
step t1_plainly 80 $B --temperatures 1 --num-prompts 8 --methods ar,ddtree --budgets 31 --no-speculate-sampled \
  --out "$O/t1_plainly"
step b16_off 90 $B --temperatures 0 --num-prompts 32 --batch 16 --methods ar,ddtree --budgets 31 \
  --budget-schedule 16:0 --out "$O/b16_off"
for n in t1_plainly b16_off; do
  echo "$n:"; tr '\r' '\n' < "$O/$n.log" | grep -A3 "^method"; grep -ho '"graph_fallbacks": [^,}]*' "$O/$n/results.json" | sort | uniq -c
done
tar czf "$O/bench.tgz" -C "$O" t1_plainly b16_off 2>/dev/null && rm -rf "$O/t1_plainly" "$O/b16_off"
step tests 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py \
  -k "gpu_context or prefill_would" --durations=4
tail -n 6 "$O/tests.log"; grep -h FAILED "$O/tests.log" | head
