#!/usr/bin/env bash
# Run 25, call 1 (random weights, no model files): a drafter engine's plain decode steps against plain
# decoding (context phase, captured states from the next layer's fused add), the DDTree round of the
# SmolLM2 shape, then tests/test_cuda_graphs.py whole on the GPU.
# Usage: OUT=dir LIMIT=s bash benchmarks/results/2026-12-02_h200_run25/call1.sh
set -uo pipefail
O=$(realpath -m "${OUT:-out}"); mkdir -p "$O"
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
git log -1 --format=%h > "$O/commit.txt" 2>/dev/null
step() {
  [ $((SECONDS + $2)) -gt ${LIMIT:-500} ] && { echo "$1: skipped (time)"; return; }
  local t0=$SECONDS; timeout $2 "${@:3}" > "$O/$1.log" 2>&1; echo "$1: rc $? in $((SECONDS - t0)) s"
}
B="python3 -m drafttree.cli bench --random-weights smollm2-135m --max-tokens 128 --budgets 31"
step t1_plainly 80 $B --temperatures 1 --num-prompts 8 --methods ar,ddtree --no-speculate-sampled --out "$O/t1_plainly"
step b16_off 90 $B --temperatures 0 --num-prompts 32 --batch 16 --methods ar,ddtree --budget-schedule 16:0 \
  --out "$O/b16_off"
for n in t1_plainly b16_off; do
  echo "$n:"; tr '\r' '\n' < "$O/$n.log" | grep -A3 "^method"; grep -ho '"graph_fallbacks": [^,}]*' "$O/$n/results.json" | sort | uniq -c
done
tar czf "$O/bench.tgz" -C "$O" t1_plainly b16_off 2>/dev/null && rm -rf "$O/t1_plainly" "$O/b16_off"
step phases 100 python3 -m drafttree.bench.phases --random-weights smollm2-135m --spec ddtree --budget 31 \
  --tree-budgets "" --out "$O/phases.json"
tail -n 8 "$O/phases.log"
step tests $((${LIMIT:-500} - SECONDS - 5)) python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py --durations=5
tail -n 8 "$O/tests.log"; grep -h FAILED "$O/tests.log" | head
