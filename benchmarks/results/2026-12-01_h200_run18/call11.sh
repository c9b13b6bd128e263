#!/usr/bin/env bash
# Run 18, call 11 (acd3d78, with its diff in .ab/fused_metadata.diff): the rope tables and the
# attention mask of a round as compiled pieces (one kernel each instead of five and nine) against
# the torch ops before them (the package as it was, rebuilt in /tmp by reversing that diff), on
# the SmolLM2-135M shape's DDTree round, alternating, one process each.
# Usage: mkdir -p .ab && git diff 7bcd984 acd3d78 -- drafttree/models/layers.py drafttree/runner/kv_cache.py \
#          > .ab/fused_metadata.diff && OUT=dir bash benchmarks/results/2026-12-01_h200_run18/call11.sh
set -uo pipefail
O=$(realpath -m "${OUT:-out}"); mkdir -p "$O/logs"; L=$O/logs
export PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
rm -rf /tmp/old && mkdir -p /tmp/old && cp -r drafttree /tmp/old/ && (cd /tmp/old && patch -s -R -p1 < "$OLDPWD/.ab/fused_metadata.diff")
P="--batch 1 --prompt-len 512 --max-model-len 2048 --iters 30 --tree-budgets"
for i in 1 2; do
  for v in new old; do
    root=$PWD; [ $v = old ] && root=/tmp/old   # `python -m` imports from the working directory first
    (cd $root && PYTHONPATH=$root:/tmp/site timeout 50 python3 -m drafttree.bench.phases $P "" --random-weights smollm2-135m \
      --spec ddtree --budget 32 --block-size 16 --out "$L/ddtree_${v}_$i.json" > "$L/ddtree_${v}_$i.txt" 2>&1)
    echo "ddtree $v $i: $(grep -h '"draft_and\|"verify_acc\|"round"\|Error' "$L/ddtree_${v}_$i.txt" | tail -3 | tr -s ' \n' ' ')"
  done
done
tar czf "$O/logs.tgz" -C "$O" logs && rm -rf "$L"
