#!/usr/bin/env bash
# Run 14, call 2: two one-token projections in one launch (gemv_kernel._gemv_chain_kernel), the
# second's programs loading their first weight tile while the first's finish, then waiting on a
# counter. DRAFTTREE_GEMV_CHAIN: og = o then gate/up, gd = gate/up then down, dq = down then the next
# layer's QKV. Qwen3-8B shape, batch 1; then the kernel tests with og,dq on the GPU.
# Usage: OUT=dir bash benchmarks/results/2026-11-30_h200_run14/call2.sh
set -uo pipefail
O=${OUT:-out}; mkdir -p "$O/logs"; L=$O/logs
export PYTHONPATH=.:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
phases() { timeout 120 python3 -m drafttree.bench.phases --batch 1 --prompt-len 512 --max-model-len 2048 \
    --iters 30 --random-weights qwen3-8b "$@"; }
for c in none og og,dq gd dq none og,dq; do
  DRAFTTREE_GEMV_CHAIN=$c phases --spec none --tree-budgets "" --out "$L/decode_$c.json" > "$L/decode_$c.txt" 2>&1
  echo "chain=$c rc=$?: $(grep -h '"decode"' "$L/decode_$c.txt" | tail -1)"
done
DRAFTTREE_GEMV_CHAIN=og,dq timeout 120 python3 -m pytest tests/test_gemv_kernel.py -q -p no:cacheprovider \
  > "$L/test_gemv_og_dq.log" 2>&1
echo "test_gemv_kernel (og,dq): $(tail -n 1 "$L/test_gemv_og_dq.log")"; grep -h "^FAILED" "$L/test_gemv_og_dq.log"
DRAFTTREE_GEMV_CHAIN=og,dq timeout 150 python3 benchmarks/profile_decode.py qwen3-8b none > "$L/profile_og_dq.txt" 2>&1
head -1 "$L/profile_og_dq.txt"; grep -A10 -- "-----" "$L/profile_og_dq.txt" | cut -c1-100,180-240 | head -12
tar czf "$O/logs.tgz" -C "$O" logs && rm -rf "$L"
