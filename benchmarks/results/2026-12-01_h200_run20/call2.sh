#!/usr/bin/env bash
# Run 20, call 2 (carries the GGUF's first part): per-class steps before the wait (the code:
# 2 under 2^22 weight elements, 0 above) against DRAFTTREE_GEMM_PREFETCH=4 and =0, on the
# SmolLM2-135M shape's DDTree round (B = 32, block 16), alternating, one process each; the
# Qwen3-8B shape at the code and with the drafter's attention as before (/tmp/old: the package
# with the dflash diff reversed, the code's tiles).
# Usage: git diff -- drafttree/models/dflash.py > .ab/dflash_attend.diff (against the commit before)
#        OUT=dir bash benchmarks/results/2026-12-01_h200_run20/call2.sh
set -uo pipefail
O=$(realpath -m "${OUT:-out}"); mkdir -p "$O/logs"; L=$O/logs
export PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
rm -f /tmp/gguf.asm; cat .parts/g3.00 >> /tmp/gguf.asm; ls -la /tmp/gguf.asm
rm -rf /tmp/old && mkdir -p /tmp/old && cp -r drafttree /tmp/old/ && (cd /tmp/old && patch -s -R -p1 < "$OLDPWD/.ab/dflash_attend.diff")
P="--batch 1 --prompt-len 512 --max-model-len 2048 --iters 30 --tree-budgets"
phases() {   # name, shape, seconds, package root, extra env (skipped where it could end past 540 s)
  [ $((SECONDS + $3)) -gt 540 ] && { echo "$1: skipped (time)"; return; }
  (cd $4 && env PYTHONPATH=$4:/tmp/site ${5:-} timeout $3 python3 -m drafttree.bench.phases $P "" --random-weights $2 \
    --spec ddtree --budget 32 --block-size 16 --out "$L/$1.json" > "$L/$1.txt" 2>&1)
  echo "$1: $(grep -h '"decode"\|"draft_and\|"verify_acc\|"round"\|Error\|failed' "$L/$1.txt" | tail -5 | tr -s ' \n' ' ')"
}
phases smol_code_0 smollm2-135m 170 $PWD
for i in 1 2; do
  phases smol_pre4_$i smollm2-135m 60 $PWD DRAFTTREE_GEMM_PREFETCH=4
  phases smol_code_$i smollm2-135m 60 $PWD
  phases smol_pre0_$i smollm2-135m 60 $PWD DRAFTTREE_GEMM_PREFETCH=0
done
phases qwen_code_1 qwen3-8b 110 $PWD
phases qwen_old_1 qwen3-8b 70 /tmp/old
phases qwen_code_2 qwen3-8b 70 $PWD
tar czf "$O/logs.tgz" -C "$O" logs && rm -rf "$L"
