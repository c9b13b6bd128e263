#!/usr/bin/env bash
# Run 14, call 8: how many programs the few-row attention's split launch aims for
# (attn_kernel.TARGET_PROGRAMS, 264 in the code), for the Qwen3-8B decode step and DDTree round.
# Usage: OUT=dir bash benchmarks/results/2026-11-30_h200_run14/call8.sh
set -uo pipefail
O=${OUT:-out}; mkdir -p "$O/logs"; L=$O/logs
export PYTHONPATH=.:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
phases() {   # TARGET_PROGRAMS ARGS
  timeout 120 python3 -c "import sys, drafttree.models.attn_kernel as a; a.TARGET_PROGRAMS = $1
from drafttree.bench.phases import main; sys.exit(main())" --batch 1 --prompt-len 512 --max-model-len 2048 \
    --iters 30 --random-weights qwen3-8b "${@:2}"
}
for t in 264 66 132 528 264; do
  phases $t --spec none --tree-budgets "" --out "$L/decode_tp$t.json" > "$L/decode_tp$t.txt" 2>&1
  echo "target_programs=$t: $(grep -h '"decode"' "$L/decode_tp$t.txt" | tail -1)"
done
for t in 264 132 528; do
  phases $t --spec ddtree --budget 32 --block-size 16 --tree-budgets "" --out "$L/ddtree_tp$t.json" > "$L/ddtree_tp$t.txt" 2>&1
  echo "ddtree target_programs=$t:"; grep -h '"decode"\|"round\|draft_and\|verify_acc' "$L/ddtree_tp$t.txt" | tail -4
done
tar czf "$O/logs.tgz" -C "$O" logs && rm -rf "$L"
