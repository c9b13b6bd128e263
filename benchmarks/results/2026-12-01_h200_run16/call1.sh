#!/usr/bin/env bash
# Run 16, call 1: programmatic dependent launch (PDL) for the layer kernels. The graphed bf16
# tokens with PDL against without; the decode step and the DDTree round, PDL on / off / on.
# Usage: OUT=dir bash benchmarks/results/2026-12-01_h200_run16/call1.sh
set -uo pipefail
O=${OUT:-out}; mkdir -p "$O/logs"; L=$O/logs
export PYTHONPATH=.:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
timeout 120 python3 -m pytest tests/test_cuda_graphs.py -k "dependent" -q -p no:cacheprovider > "$L/tests.log" 2>&1
echo "tests: $(tail -n 1 "$L/tests.log")"; grep -h "^FAILED\|Error" "$L/tests.log" | head -5
P="--batch 1 --prompt-len 512 --max-model-len 2048 --iters 30 --random-weights qwen3-8b --tree-budgets"
i=0
for p in 1 0 1; do
  i=$((i + 1))
  DRAFTTREE_PDL=$p timeout 80 python3 -m drafttree.bench.phases $P "" --spec none --out "$L/decode_${i}_pdl$p.json" \
    > "$L/decode_${i}_pdl$p.txt" 2>&1
  echo "decode PDL=$p: $(grep -h '"decode"\|Error' "$L/decode_${i}_pdl$p.txt" | tail -2)"
done
for p in 1 0; do
  i=$((i + 1))
  DRAFTTREE_PDL=$p timeout 100 python3 -m drafttree.bench.phases $P "" --spec ddtree --budget 32 --block-size 16 \
    --out "$L/ddtree_${i}_pdl$p.json" > "$L/ddtree_${i}_pdl$p.txt" 2>&1
  echo "ddtree PDL=$p:"; grep -h '"decode"\|"round\|draft_and\|verify_acc\|Error' "$L/ddtree_${i}_pdl$p.txt" | tail -5
done
tar czf "$O/logs.tgz" -C "$O" logs && rm -rf "$L"
