#!/usr/bin/env bash
# Run 25, call 5 (random logits only): the threshold kernel alone at several chunk sizes against
# the sort (benchmarks/filter_bench.py), and the test the GPU failed in call 2 (its own device mix-up).
# Usage: OUT=dir LIMIT=s bash benchmarks/results/2026-12-02_h200_run25/call5.sh
set -uo pipefail
O=$(realpath -m "${OUT:-out}"); mkdir -p "$O"
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
step() {
  [ $((SECONDS + $2)) -gt ${LIMIT:-500} ] && { echo "$1: skipped (time)"; return; }
  local t0=$SECONDS; timeout $2 "${@:3}" > "$O/$1.log" 2>&1; echo "$1: rc $? in $((SECONDS - t0)) s"
}
step filter_bench 150 python3 benchmarks/filter_bench.py --out "$O/filter_bench.json"
grep -v Warn "$O/filter_bench.log" | tail -n 14
step tests 60 python3 -m pytest -q -p no:cacheprovider tests/test_filter_kernel.py
tail -n 3 "$O/tests.log"; grep -h FAILED "$O/tests.log" | head
