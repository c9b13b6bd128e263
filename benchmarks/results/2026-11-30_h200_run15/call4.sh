#!/usr/bin/env bash
# Run 15, call 4, at the final blocks (gemm_kernel.BLOCKS: the o and down projections of 2^24
# elements and more through the few-row kernel, the rest through the torch ops): the GEMV/GEMM tests,
# bf16 graphs against eager through the fused projections, the decode step, the DDTree round with
# and without the few-row kernel, and the DFlash round.
# Usage: OUT=dir bash benchmarks/results/2026-11-30_h200_run15/call4.sh
set -uo pipefail
O=${OUT:-out}; mkdir -p "$O/logs"; L=$O/logs
export PYTHONPATH=.:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
timeout 200 python3 -m pytest tests/test_gemv_kernel.py tests/test_cuda_graphs.py -k "gemv or gemm or fused or bf16 or draft_layer or rows" \
  -q -p no:cacheprovider > "$L/tests.log" 2>&1
echo "tests: $(tail -n 1 "$L/tests.log")"; grep -h "^FAILED" "$L/tests.log"
P="--batch 1 --prompt-len 512 --max-model-len 2048 --iters 30 --random-weights qwen3-8b --tree-budgets"
timeout 90 python3 -m drafttree.bench.phases $P "" --spec none --out "$L/decode.json" > "$L/decode.txt" 2>&1
echo "decode: $(grep -h '"decode"' "$L/decode.txt" | tail -1)"
i=0
for g in 1 0; do
  i=$((i + 1))
  DRAFTTREE_GEMM=$g timeout 100 python3 -m drafttree.bench.phases $P "" --spec ddtree --budget 32 --block-size 16 \
    --out "$L/ddtree_${i}_gemm$g.json" > "$L/ddtree_${i}_gemm$g.txt" 2>&1
  echo "ddtree GEMM=$g:"; grep -h '"decode"\|"round\|draft_and\|verify_acc\|Error' "$L/ddtree_${i}_gemm$g.txt" | tail -5
done
timeout 100 python3 -m drafttree.bench.phases $P "" --spec dflash --block-size 16 --out "$L/dflash.json" > "$L/dflash.txt" 2>&1
echo "dflash:"; grep -h '"decode"\|"round\|draft\|verify_acc\|Error' "$L/dflash.txt" | tail -5
tar czf "$O/logs.tgz" -C "$O" logs && rm -rf "$L"
