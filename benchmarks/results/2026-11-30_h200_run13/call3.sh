#!/usr/bin/env bash
# Run 13, call 3: the projections (per-lane sums, the default since call 2) with and without the
# weight prefetch, each at its own sweep's blocks; the SmolLM2 shape's sweep; decode step and
# DDTree round at the committed defaults (Qwen3-8B shape).
# Usage: OUT=dir bash benchmarks/results/2026-11-30_h200_run13/call3.sh
set -uo pipefail
O=${OUT:-out}; mkdir -p "$O/logs"; L=$O/logs
export PYTHONPATH=.:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
phases() {   # BEST.json|"" ARGS
  timeout 150 python3 -c "import json, sys, drafttree.models.gemv_kernel as g
[g.set_blocks(kind, numel, tuple(b), split=True) for kind, numel, b in (json.load(open('$1')) if '$1' else [])]
from drafttree.bench.phases import main; sys.exit(main())" --batch 1 --prompt-len 512 --max-model-len 2048 \
    --iters 30 --random-weights qwen3-8b "${@:2}"
}
DRAFTTREE_GEMV_PREFETCH=1 timeout 150 python3 benchmarks/gemv_bench.py --block-n 4,8,16 --block-k 512,1024 --warps 4,8 \
  --out "$L/best_prefetch1.json" > "$L/gemv_prefetch1.txt" 2>&1
echo "prefetch=1:"; grep -v "^  fused" "$L/gemv_prefetch1.txt"
for p in 0 1 0 1; do
  b=""; [ $p = 1 ] && b="$L/best_prefetch1.json"
  DRAFTTREE_GEMV_PREFETCH=$p phases "$b" --spec none --tree-budgets "" --out "$L/decode_prefetch$p.json" \
    > "$L/decode_prefetch$p.txt" 2>&1
  echo "prefetch=$p ${b:-code blocks}: $(grep -h '"decode"' "$L/decode_prefetch$p.txt" | tail -1)"
done
phases "" --spec ddtree --budget 32 --block-size 16 --tree-budgets 32 --out "$L/ddtree.json" > "$L/ddtree.txt" 2>&1
grep -h '"decode"\|"round\|draft_and\|verify_acc\|tree_build' "$L/ddtree.txt"
timeout 100 python3 benchmarks/gemv_bench.py --shape smollm2-135m --block-n 2,4,8,16 --block-k 256,512 --warps 4,8 \
  --out "$L/best_smollm2.json" > "$L/gemv_smollm2.txt" 2>&1
echo "smollm2:"; grep -v "^  fused" "$L/gemv_smollm2.txt"
tar czf "$O/logs.tgz" -C "$O" logs && rm -rf "$L"
