#!/usr/bin/env bash
# Run 27, call 2: the fp8 drafter's tiles widening e4m3 to bf16 ("widen") against f16 dots ("f16"),
# both at the code's BLOCKS_FP8, and "f16" at call 1's f16 sweep: the Qwen3-8B-shaped DDTree round,
# alternating, then the SmolLM2-shaped round (bf16, widen, f16). GPU tests of the fp8 tiles with
# f16 dots (tiles, Fp8Linear, graph replay against eager).
# Usage: OUT=dir LIMIT=s bash benchmarks/results/2026-12-02_h200_run27/call2.sh
set -uo pipefail
O=$(realpath -m "${OUT:-out}"); mkdir -p "$O"
R=benchmarks/results/2026-12-02_h200_run27
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
step() {
  [ $((SECONDS + $2)) -gt ${LIMIT:-560} ] && { echo "$1: skipped (time)"; return; }
  local t0=$SECONDS; timeout $2 "${@:3}" > "$O/$1.log" 2>&1; echo "$1: rc $? in $((SECONDS - t0)) s"
}
round() {   # NAME BEST.json SHAPE BUDGET [ARGS]: a DDTree round, the fp8 tiles at BEST's blocks
  step $1 90 python3 -c "import json, os, sys
from drafttree.models import gemm_kernel as g
for kind, numel, blocks, us, _ in json.load(open('$2')) if os.path.exists('$2') else []:
    g.set_blocks(kind, numel, tuple(blocks), split=True, table=g.BLOCKS_FP8)
print(g.FP8_DOT, g.BLOCKS_FP8)
from drafttree.bench.phases import main; sys.exit(main())" --random-weights $3 --batch 1 --prompt-len 512 \
    --max-model-len 2048 --iters 30 --tree-budgets "" --spec ddtree --budget $4 --block-size 16 "${@:5}"
  echo "$1 $(python3 -c "import json, re, sys; t = open('$O/$1.log').read(); d = json.loads(t[t.index('\n{\n') + 1:])['graph_ms']
print(' '.join(f'{k} {v:.3f}' for k, v in d.items()))" 2>&1 | tail -1)"
}
Q="qwen3-8b 32 --draft-quantization fp8"
for i in 1 2; do
  DRAFTTREE_FP8_DOT=f16 round qwen_f16_code_$i none $Q
  DRAFTTREE_FP8_DOT=widen round qwen_widen_code_$i none $Q
  DRAFTTREE_FP8_DOT=f16 round qwen_f16_sweep_$i $R/1_fp8_dots/best_f16.json $Q
done
round smol_bf16 none smollm2-135m 31
DRAFTTREE_FP8_DOT=widen round smol_widen none smollm2-135m 31 --draft-quantization fp8
DRAFTTREE_FP8_DOT=f16 round smol_f16 none smollm2-135m 31 --draft-quantization fp8
DRAFTTREE_FP8_DOT=f16 step tests_quant 100 python3 -m pytest -q --tb=line -p no:cacheprovider tests/test_quant.py \
  -k "tiles or linear or graphed"
grep -v "^  " "$O/tests_quant.log" | tail -n 6
cd "$O" && tar czf ../run27_call2.tgz . && rm -rf ./* && mv ../run27_call2.tgz .   # one file back
