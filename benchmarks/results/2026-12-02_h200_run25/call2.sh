#!/usr/bin/env bash
# Run 25, call 2 (carries the GGUF's first half, appended under /tmp for call 3): the sort-free
# top-k/top-p thresholds on the GPU (their tests, the sampling and graph tests of filtered batches),
# the sampler alone (threshold kernel against the sort), and filtered sampled decoding of the
# random-weight SmolLM2 shape (T = 1, top-p 0.95), kernel on and off.
# Usage: OUT=dir LIMIT=s bash benchmarks/results/2026-12-02_h200_run25/call2.sh
set -uo pipefail
O=$(realpath -m "${OUT:-out}"); mkdir -p "$O"
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
[ -f .parts/gh.00 ] && cp .parts/gh.00 /tmp/gguf.asm
step() {
  [ $((SECONDS + $2)) -gt ${LIMIT:-500} ] && { echo "$1: skipped (time)"; return; }
  local t0=$SECONDS; timeout $2 "${@:3}" > "$O/$1.log" 2>&1; echo "$1: rc $? in $((SECONDS - t0)) s"
}
step tests 170 python3 -m pytest -q -p no:cacheprovider tests/test_filter_kernel.py tests/test_spec_sampling.py \
  tests/test_fused.py -k "filter or sampl or top or thresh" --durations=4
tail -n 6 "$O/tests.log"; grep -h FAILED "$O/tests.log" | head
step sampler 100 python3 benchmarks/sampler_bench.py --out "$O/sampler.json"
grep -v Warn "$O/sampler.log" | tail -n 12
B="python3 -m drafttree.cli bench --random-weights smollm2-135m --max-tokens 128 --budgets 31 --temperatures 1 --top-p 0.95"
step t1_topp 90 $B --num-prompts 8 --methods ar,ddtree --no-speculate-sampled --out "$O/t1_topp"
step t1_topp_sort 90 env DRAFTTREE_FILTER_KERNEL=0 $B --num-prompts 8 --methods ar,ddtree --no-speculate-sampled \
  --out "$O/t1_topp_sort"
for n in t1_topp t1_topp_sort; do
  echo "$n:"; tr '\r' '\n' < "$O/$n.log" | grep -A3 "^method"; grep -ho '"graph_fallbacks": [^,}]*' "$O/$n/results.json" | sort | uniq -c
done
tar czf "$O/bench.tgz" -C "$O" t1_topp t1_topp_sort 2>/dev/null && rm -rf "$O/t1_topp" "$O/t1_topp_sort"
