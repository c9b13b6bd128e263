#!/usr/bin/env bash
# Run 14, call 9: SiLU·up as the gate/up projection's epilogue (gemv_kernel.norm_glu_gemv; the
# down projection then a plain GEMV), DRAFTTREE_GEMV_GLU=1, against the prologue in the down
# projection (=0): each at its own sweep's blocks, Qwen3-8B shape, batch 1; the kernel tests on the
# GPU; the SmolLM2 shape's sweep.
# Usage: OUT=dir bash benchmarks/results/2026-11-30_h200_run14/call9.sh
set -uo pipefail
O=${OUT:-out}; mkdir -p "$O/logs"; L=$O/logs
export PYTHONPATH=.:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
phases() {   # BEST.json|"" ARGS
  timeout 100 python3 -c "import json, sys, drafttree.models.gemv_kernel as g
[g.set_blocks(kind, numel, tuple(b), split=True) for kind, numel, b in (json.load(open('$1')) if '$1' else [])
 if kind == 'glu' or numel >= 1 << 25]   # the sweep's blocks for gate/up and down only
from drafttree.bench.phases import main; sys.exit(main())" --batch 1 --prompt-len 512 --max-model-len 2048 \
    --iters 30 --random-weights qwen3-8b "${@:2}"
}
DRAFTTREE_GEMV_GLU=1 timeout 150 python3 benchmarks/gemv_bench.py --block-n 2,4,8,16 --block-k 1024 --warps 4,8 \
  --out "$L/best_glu1.json" > "$L/gemv_glu1.txt" 2>&1
echo "glu=1:"; grep -v "^  fused" "$L/gemv_glu1.txt"
for v in 0 1 0 1; do
  b=""; [ $v = 1 ] && b="$L/best_glu1.json"
  DRAFTTREE_GEMV_GLU=$v phases "$b" --spec none --tree-budgets "" --out "$L/decode_glu$v.json" > "$L/decode_glu$v.txt" 2>&1
  echo "glu=$v ${b:-code blocks}: $(grep -h '"decode"' "$L/decode_glu$v.txt" | tail -1)"
done
timeout 90 python3 -m pytest tests/test_gemv_kernel.py -q -p no:cacheprovider > "$L/test_gemv_kernel.log" 2>&1
echo "test_gemv_kernel: $(tail -n 1 "$L/test_gemv_kernel.log")"; grep -h "^FAILED" "$L/test_gemv_kernel.log"
DRAFTTREE_GEMV_GLU=1 timeout 60 python3 benchmarks/gemv_bench.py --shape smollm2-135m --block-n 2,4,8 --block-k 256,512 \
  --warps 4 --out "$L/best_smollm2.json" > "$L/gemv_smollm2.txt" 2>&1
echo "smollm2:"; grep -v "^  fused" "$L/gemv_smollm2.txt"
tar czf "$O/logs.tgz" -C "$O" logs && rm -rf "$L"
