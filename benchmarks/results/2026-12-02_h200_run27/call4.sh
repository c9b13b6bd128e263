#!/usr/bin/env bash
# Run 27, call 4: where the Qwen3-8B-shaped DDTree round goes now, PDL off, with the fp8 drafter
# (f16 dots) and with the bf16 drafter (`benchmarks/profile_decode.py`, five graphed rounds).
# Usage: OUT=dir LIMIT=s bash benchmarks/results/2026-12-02_h200_run27/call4.sh
set -uo pipefail
O=$(realpath -m "${OUT:-out}"); mkdir -p "$O"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache DRAFTTREE_PDL=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
step() {
  [ $((SECONDS + $2)) -gt ${LIMIT:-560} ] && { echo "$1: skipped (time)"; return; }
  local t0=$SECONDS; timeout $2 "${@:3}" > "$O/$1.log" 2>&1; echo "$1: rc $? in $((SECONDS - t0)) s"
}
step profile_fp8 120 python3 benchmarks/profile_decode.py qwen3-8b ddtree fp8
step profile_bf16 120 python3 benchmarks/profile_decode.py qwen3-8b ddtree
grep -h "graphed rounds\|Self CUDA time total" "$O"/profile_*.log
cd "$O" && tar czf ../run27_call4.tgz . && rm -rf ./* && mv ../run27_call4.tgz .   # one file back
