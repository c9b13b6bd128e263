#!/usr/bin/env bash
# Run 16, call 2: PDL modes (1: the next kernel starts once all programs have waited; 2: once all
# have started) and the GEMVs' weight steps loaded before the wait (DRAFTTREE_GEMV_PREFETCH:
# norm, plain, glu). GPU tests of both; the decode step and the DDTree round per setting.
# Usage: OUT=dir bash benchmarks/results/2026-12-01_h200_run16/call2.sh
set -uo pipefail
O=${OUT:-out}; mkdir -p "$O/logs"; L=$O/logs
export PYTHONPATH=.:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
DRAFTTREE_PDL=2 timeout 100 python3 -m pytest tests/test_cuda_graphs.py -k "dependent" -q -p no:cacheprovider > "$L/tests_pdl2.log" 2>&1
echo "tests PDL=2: $(tail -n 1 "$L/tests_pdl2.log")"; grep -h "^FAILED" "$L/tests_pdl2.log" | head -5
timeout 100 python3 -m pytest tests/test_gemv_kernel.py -k "1row" -q -p no:cacheprovider > "$L/tests_gemv.log" 2>&1
echo "tests gemv 1row (prefetch 4 included): $(tail -n 1 "$L/tests_gemv.log")"; grep -h "^FAILED" "$L/tests_gemv.log" | head -5
P="--batch 1 --prompt-len 512 --max-model-len 2048 --iters 30 --random-weights qwen3-8b --tree-budgets"
i=0
for cfg in 1:1,1,1 2:1,1,1 2:2,2,2 2:1,2,1 1:2,2,2 2:2,1,2 0:1,1,1 2:1,1,1; do
  i=$((i + 1)); p=${cfg%%:*}; f=${cfg#*:}
  DRAFTTREE_PDL=$p DRAFTTREE_GEMV_PREFETCH=$f timeout 60 python3 -m drafttree.bench.phases $P "" --spec none \
    --out "$L/decode_${i}.json" > "$L/decode_${i}.txt" 2>&1
  echo "decode $i PDL=$p prefetch=$f: $(grep -h '"decode"\|Error' "$L/decode_${i}.txt" | tail -1)"
done
for cfg in 2:1,1,1 1:1,1,1; do
  i=$((i + 1)); p=${cfg%%:*}; f=${cfg#*:}
  DRAFTTREE_PDL=$p DRAFTTREE_GEMV_PREFETCH=$f timeout 80 python3 -m drafttree.bench.phases $P "" --spec ddtree --budget 32 \
    --block-size 16 --out "$L/ddtree_${i}.json" > "$L/ddtree_${i}.txt" 2>&1
  echo "ddtree $i PDL=$p prefetch=$f:"; grep -h '"decode"\|"round\|draft_and\|verify_acc\|Error' "$L/ddtree_${i}.txt" | tail -5
done
tar czf "$O/logs.tgz" -C "$O" logs && rm -rf "$L"
