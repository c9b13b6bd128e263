#!/usr/bin/env bash
# Run 24, call 1: the GGUF's first half to /tmp; the sampler alone (torch ops against its compiled
# piece); tests/test_fused.py alone; the sampling tests and the graph tests of sampled batches.
# Usage: OUT=dir LIMIT=s bash benchmarks/results/2026-12-02_h200_run24/call1.sh
set -uo pipefail
O=$(realpath -m "${OUT:-out}"); mkdir -p "$O"
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
[ -f .parts/gh.00 ] && cp .parts/gh.00 /tmp/gguf.asm
step() {   # name, seconds, command...
  [ $((SECONDS + $2)) -gt ${LIMIT:-500} ] && { echo "$1: skipped (time)"; return; }
  local t0=$SECONDS; timeout $2 "${@:3}" > "$O/$1.log" 2>&1; echo "$1: rc $? in $((SECONDS - t0)) s"
}
step sampler 120 python3 benchmarks/sampler_bench.py --out "$O/sampler.json"
grep -v Warn "$O/sampler.log" | tail -n 12
step test_fused 150 python3 -m pytest -q -p no:cacheprovider tests/test_fused.py --durations=5
tail -n 8 "$O/test_fused.log"
step tests_sampling 230 python3 -m pytest -q -p no:cacheprovider tests/test_spec_sampling.py tests/test_cuda_graphs.py \
  -k "sampl or replay or schedule" --durations=5
tail -n 8 "$O/tests_sampling.log"; grep -h FAILED "$O"/*.log | head
