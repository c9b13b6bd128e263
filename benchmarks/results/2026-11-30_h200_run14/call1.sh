#!/usr/bin/env bash
# Run 14, call 1: the next projections' weights prefetched into L2 (cp.async.bulk.prefetch.L2) by the
# attention's split launch, while the attention waits on latency. DRAFTTREE_L2PF_POS 0 off, 1 at the
# split's start, 2 after its key loop; DRAFTTREE_L2PF_GU_MB the first MiB of gate/up too (decode);
# DRAFTTREE_L2PF_WIDE=1 the o weights in wider forwards (verify). Qwen3-8B shape, batch 1.
# Usage: OUT=dir bash benchmarks/results/2026-11-30_h200_run14/call1.sh
set -uo pipefail
O=${OUT:-out}; mkdir -p "$O/logs"; L=$O/logs
export PYTHONPATH=.:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
phases() { timeout 150 python3 -m drafttree.bench.phases --batch 1 --prompt-len 512 --max-model-len 2048 \
    --iters 30 --random-weights qwen3-8b "$@"; }
for v in 0:0 1:0 2:0 1:8 1:16 0:0 1:0 2:16; do
  p=${v%:*}; g=${v#*:}
  DRAFTTREE_L2PF_POS=$p DRAFTTREE_L2PF_GU_MB=$g phases --spec none --tree-budgets "" --out "$L/decode_${p}_$g.json" \
    > "$L/decode_${p}_$g.txt" 2>&1
  echo "pos=$p gu_mb=$g: $(grep -h '"decode"' "$L/decode_${p}_$g.txt" | tail -1)"
done
for v in 0:0:0 1:0:1 1:16:1 0:0:0; do
  IFS=: read p g w <<< "$v"
  DRAFTTREE_L2PF_POS=$p DRAFTTREE_L2PF_GU_MB=$g DRAFTTREE_L2PF_WIDE=$w phases --spec ddtree --budget 32 --block-size 16 \
    --tree-budgets "" --out "$L/ddtree_$v.json" > "$L/ddtree_$v.txt" 2>&1
  echo "ddtree pos=$p gu_mb=$g wide=$w:"; grep -h '"decode"\|"round\|draft_and\|verify_acc' "$L/ddtree_$v.txt" | tail -4
done
DRAFTTREE_L2PF_POS=1 timeout 150 python3 benchmarks/profile_decode.py qwen3-8b none > "$L/profile_pf1.txt" 2>&1
head -1 "$L/profile_pf1.txt"; grep -A14 -- "-----" "$L/profile_pf1.txt" | cut -c1-100,180-240 | head -16
tar czf "$O/logs.tgz" -C "$O" logs && rm -rf "$L"
