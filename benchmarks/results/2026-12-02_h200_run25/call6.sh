#!/usr/bin/env bash
# Run 25, call 6 (random logits only): the threshold kernel at the chunks planned from call 5, against
# the sort, and the kernel's tests (two had mixed devices in call 5; fixed).
# Usage: OUT=dir LIMIT=s bash benchmarks/results/2026-12-02_h200_run25/call6.sh
set -uo pipefail
O=$(realpath -m "${OUT:-out}"); mkdir -p "$O"
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
step() {
  [ $((SECONDS + $2)) -gt ${LIMIT:-500} ] && { echo "$1: skipped (time)"; return; }
  local t0=$SECONDS; timeout $2 "${@:3}" > "$O/$1.log" 2>&1; echo "$1: rc $? in $((SECONDS - t0)) s"
}
step filter_bench 150 python3 benchmarks/filter_bench.py --chunks 2048,8192 --out "$O/filter_bench.json"
grep -v Warn "$O/filter_bench.log" | tail -n 14
step tests 60 python3 -m pytest -q -p no:cacheprovider tests/test_filter_kernel.py
tail -n 3 "$O/tests.log"; grep -h FAILED "$O/tests.log" | head
