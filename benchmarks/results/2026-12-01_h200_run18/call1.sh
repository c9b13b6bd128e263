#!/usr/bin/env bash
# Run 18, call 1: the attention's merge inside its split launch (the last split program of a
# row block merges; DRAFTTREE_ATTN_MERGE_IN_SPLIT = most rows per program that do, 0 = the merge
# launch), A/B on the Qwen3-8B shape's decode step and DDTree round, twice each; the QKV tile with
# its norm prologue for weights from 2^24 elements in the round (DRAFTTREE_BLOCKS); a PDL-off
# kernel profile of the round. Carries the GGUF's first part (appended to /tmp/gguf.asm).
# Usage: OUT=dir bash benchmarks/results/2026-12-01_h200_run18/call1.sh
set -uo pipefail
O=${OUT:-out}; mkdir -p "$O/logs"; L=$O/logs
export PYTHONPATH=.:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
rm -f /tmp/gguf.asm; cat .parts/g3.00 >> /tmp/gguf.asm; ls -l /tmp/gguf.asm
P="--batch 1 --prompt-len 512 --max-model-len 2048 --iters 30 --tree-budgets"
round() {   # NAME SHAPE ENV...: one DDTree phases run
  name=$1 shape=$2; shift 2
  env "$@" timeout 90 python3 -m drafttree.bench.phases $P "" --random-weights $shape --spec ddtree --budget 32 \
    --block-size 16 --out "$L/$name.json" > "$L/$name.txt" 2>&1
  echo "$name ($*): $(grep -h '"decode"\|"round"\|"round_in\|draft_and\|verify_acc\|Error' "$L/$name.txt" | tail -5 | tr -s ' \n' ' ')"
}
for i in 1 2; do
  round qwen_merge16_$i qwen3-8b DRAFTTREE_ATTN_MERGE_IN_SPLIT=16
  round qwen_merge0_$i qwen3-8b DRAFTTREE_ATTN_MERGE_IN_SPLIT=0
done
round qwen_merge64 qwen3-8b DRAFTTREE_ATTN_MERGE_IN_SPLIT=64
echo '[["norm", 25165824, [128, 64, 4, 3, 4, 64, 64]]]' > /tmp/qkv_tile.json
round qwen_qkv_tile qwen3-8b DRAFTTREE_BLOCKS=/tmp/qkv_tile.json
for m in 16 0; do round smol_merge$m smollm2-135m DRAFTTREE_ATTN_MERGE_IN_SPLIT=$m; done
DRAFTTREE_PDL=0 timeout 120 python3 benchmarks/profile_decode.py qwen3-8b ddtree > "$L/profile_qwen_ddtree_pdl0.txt" 2>&1
grep -A30 "graphed rounds" "$L/profile_qwen_ddtree_pdl0.txt" | cut -c1-92,150-175
tar czf "$O/logs.tgz" -C "$O" logs && rm -rf "$L"
