#!/usr/bin/env bash
# Run 20, call 1: the GGUF's first part; on the SmolLM2-135M and Qwen3-8B shapes' DDTree round
# (B = 32, block 16): the few-row tiles' first weight steps loaded before the PDL wait
# (DRAFTTREE_GEMM_PREFETCH = 1, the code; 0 = before; 2), and the drafter's attention in one
# rope + KV-write launch over [context ; block] rows (off: the package rebuilt in /tmp/old by
# reversing that diff), alternating, one process each; a kernel profile of the round, PDL off.
# Usage: mkdir -p .ab && git diff <before> <after> -- drafttree/models/dflash.py > .ab/dflash_attend.diff
#        OUT=dir bash benchmarks/results/2026-12-01_h200_run20/call1.sh
set -uo pipefail
O=$(realpath -m "${OUT:-out}"); mkdir -p "$O/logs"; L=$O/logs
export PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
rm -f /tmp/gguf.asm; cat .parts/g3.00 >> /tmp/gguf.asm
rm -rf /tmp/old && mkdir -p /tmp/old && cp -r drafttree /tmp/old/ && (cd /tmp/old && patch -s -R -p1 < "$OLDPWD/.ab/dflash_attend.diff")
P="--batch 1 --prompt-len 512 --max-model-len 2048 --iters 30 --tree-budgets"
phases() {   # name, shape, seconds, package root, extra env (skipped where it could end past 540 s)
  [ $((SECONDS + $3)) -gt 540 ] && { echo "$1: skipped (time)"; return; }
  (cd $4 && env PYTHONPATH=$4:/tmp/site ${5:-} timeout $3 python3 -m drafttree.bench.phases $P "" --random-weights $2 \
    --spec ddtree --budget 32 --block-size 16 --out "$L/$1.json" > "$L/$1.txt" 2>&1)
  echo "$1: $(grep -h '"decode"\|"draft_and\|"verify_acc\|"round"\|Error\|failed' "$L/$1.txt" | tail -5 | tr -s ' \n' ' ')"
}
phases smol_new_0 smollm2-135m 170 $PWD
phases smol_old_0 smollm2-135m 120 /tmp/old
for i in 1 2; do
  phases smol_new_$i smollm2-135m 60 $PWD
  phases smol_pre0_$i smollm2-135m 60 $PWD DRAFTTREE_GEMM_PREFETCH=0
  phases smol_old_$i smollm2-135m 60 /tmp/old
done
phases smol_pre2_1 smollm2-135m 60 $PWD DRAFTTREE_GEMM_PREFETCH=2
PYTHONPATH=.:/tmp/site DRAFTTREE_PDL=0 timeout 60 python3 benchmarks/profile_decode.py smollm2-135m ddtree > "$L/profile_ddtree.txt" 2>&1
echo "profile: $(grep -c . "$L/profile_ddtree.txt") lines"
phases qwen_new qwen3-8b 100 $PWD
phases qwen_pre0 qwen3-8b 60 $PWD DRAFTTREE_GEMM_PREFETCH=0
phases qwen_old qwen3-8b 60 /tmp/old
tar czf "$O/logs.tgz" -C "$O" logs && rm -rf "$L"
