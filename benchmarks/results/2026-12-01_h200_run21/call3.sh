#!/usr/bin/env bash
# Run 21, call 3 (carries the GGUF's first part): the o and down projections' split sums added by
# the norm tile after them (SplitSums) against a second launch (/tmp/old: the package with the
# split-sums diff reversed), DDTree round B = 32, block 16, SmolLM2-135M shape alternating, one
# process each, then the Qwen3-8B shape (random weights).
# Usage: git add -N drafttree; git diff HEAD -- drafttree > .ab/split_sums.diff
#        OUT=dir bash benchmarks/results/2026-12-01_h200_run21/call3.sh
set -uo pipefail
O=$(realpath -m "${OUT:-out}"); mkdir -p "$O/logs"; L=$O/logs
export PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
rm -f /tmp/gguf.asm; cat .parts/g3.00 >> /tmp/gguf.asm; ls -la /tmp/gguf.asm
rm -rf /tmp/old && mkdir -p /tmp/old && cp -r drafttree /tmp/old/ && (cd /tmp/old && patch -s -R -p1 < "$OLDPWD/.ab/split_sums.diff")
ls /tmp/old/drafttree/models/
P="--batch 1 --prompt-len 512 --max-model-len 2048 --iters 30 --tree-budgets"
phases() {   # name, shape, seconds, package root (skipped where it could end past 430 s)
  [ $((SECONDS + $3)) -gt 430 ] && { echo "$1: skipped (time)"; return; }
  (cd $4 && env PYTHONPATH=$4:/tmp/site timeout $3 python3 -m drafttree.bench.phases $P "" --random-weights $2 \
    --spec ddtree --budget 32 --block-size 16 --out "$L/$1.json" > "$L/$1.txt" 2>&1)
  echo "$1: $(grep -h '"decode"\|"draft_and\|"verify_acc\|"round"\|Error\|failed' "$L/$1.txt" | tail -5 | tr -s ' \n' ' ')"
}
phases smol_new_1 smollm2-135m 150 $PWD
phases smol_old_1 smollm2-135m 60 /tmp/old
phases smol_new_2 smollm2-135m 50 $PWD
phases smol_old_2 smollm2-135m 50 /tmp/old
phases qwen_new qwen3-8b 90 $PWD
phases qwen_old qwen3-8b 70 /tmp/old
tar czf "$O/logs.tgz" -C "$O" logs && rm -rf "$L"
