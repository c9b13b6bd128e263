#!/usr/bin/env bash
# Run 13, calls 1-2: the rope + KV write inside the attention launch (DRAFTTREE_ROPE_IN_ATTN) and
# the projections' 2-D accumulator (DRAFTTREE_GEMV_ACC2D), each A/B in one call, Qwen3-8B shape.
# Usage: OUT=dir bash benchmarks/results/2026-11-30_h200_run13/call2.sh
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
for r in 1 0 1; do
  DRAFTTREE_ROPE_IN_ATTN=$r phases "" --spec none --tree-budgets "" --out "$L/decode_rope$r.json" > "$L/decode_rope$r.txt" 2>&1
  echo "rope_in_attn=$r acc2d=0 code blocks: $(grep -h '"decode"' "$L/decode_rope$r.txt" | tail -1)"
done
timeout 120 python3 -m pytest tests/test_attn_kernel.py -q -p no:cacheprovider > "$L/test_attn_kernel.log" 2>&1
echo "test_attn_kernel: $(tail -n 1 "$L/test_attn_kernel.log")"; grep -h "^FAILED" "$L/test_attn_kernel.log"
for a in 0 1; do
  DRAFTTREE_GEMV_ACC2D=$a timeout 150 python3 benchmarks/gemv_bench.py --block-n 4,8,16 --block-k 512,1024 --warps 4,8 \
    --out "$L/best_acc$a.json" > "$L/gemv_acc$a.txt" 2>&1
  echo "acc2d=$a:"; grep -v "^  fused" "$L/gemv_acc$a.txt"
done
for a in 0 1 0 1; do
  DRAFTTREE_GEMV_ACC2D=$a phases "$L/best_acc$a.json" --spec none --tree-budgets "" --out "$L/decode_acc$a.json" \
    > "$L/decode_acc$a.txt" 2>&1
  echo "rope_in_attn=1 acc2d=$a own best: $(grep -h '"decode"' "$L/decode_acc$a.txt" | tail -1)"
done
phases "" --spec ddtree --budget 32 --block-size 16 --tree-budgets 32 --out "$L/ddtree.json" > "$L/ddtree.txt" 2>&1
grep -h '"decode"\|"round\|draft_and\|verify_acc' "$L/ddtree.txt"
DRAFTTREE_GEMV_ACC2D=1 timeout 100 python3 -m pytest tests/test_gemv_kernel.py -q -p no:cacheprovider > "$L/test_gemv_acc2d.log" 2>&1
echo "test_gemv_kernel (acc2d): $(tail -n 1 "$L/test_gemv_acc2d.log")"
tar czf "$O/logs.tgz" -C "$O" logs && rm -rf "$L"
