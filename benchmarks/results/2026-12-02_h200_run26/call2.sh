#!/usr/bin/env bash
# Run 26, call 2: the fp8 tiles' tests on the GPU (stop at the first failure); a second block sweep
# at 16 rows (deeper pipelines, narrower tiles, more input splits); then the Qwen3-8B-shaped DDTree
# round with the fp8 drafter at the fastest blocks of both sweeps (per matrix), against bf16.
# Usage: OUT=dir LIMIT=s bash benchmarks/results/2026-12-02_h200_run26/call2.sh
set -uo pipefail
O=$(realpath -m "${OUT:-out}"); mkdir -p "$O"
R=benchmarks/results/2026-12-02_h200_run26
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
step() {
  [ $((SECONDS + $2)) -gt ${LIMIT:-560} ] && { echo "$1: skipped (time)"; return; }
  local t0=$SECONDS; timeout $2 "${@:3}" > "$O/$1.log" 2>&1; echo "$1: rc $? in $((SECONDS - t0)) s"
}
step tests_quant 150 python3 -m pytest -x -q --tb=short -p no:cacheprovider tests/test_quant.py --durations=3
tail -n 30 "$O/tests_quant.log" | grep -v "^  " | head -30
step sweep_fp8 150 python3 benchmarks/gemv_bench.py --shape qwen3-8b --fp8 --rows 16 \
  --only qkv,gate_up,down,lm_head --block-n 32,64 --block-k 128 --warps 4 --stages 4,6 --splits 4,8 \
  --row-block 16 --prefetch 0 --out "$O/best_fp8_2.json"
grep -h "fastest" "$O/sweep_fp8.log"
for q in bf16 fp8 bf16 fp8; do
  step qwen_$q$SECONDS 120 python3 -c "import json, sys
from drafttree.models import gemm_kernel as g
best = {}
for f in ('$R/1_413ace5_fp8_drafter/best_fp8.json', '$O/best_fp8_2.json'):
    for kind, numel, blocks, us, _ in json.load(open(f)) if __import__('os').path.exists(f) else []:
        if (kind, numel) not in best or us < best[kind, numel][1]:
            best[kind, numel] = (blocks, us)
for (kind, numel), (blocks, us) in best.items():
    print(kind, numel, blocks, us); g.set_blocks(kind, numel, tuple(blocks), split=True, table=g.BLOCKS_FP8)
from drafttree.bench.phases import main; sys.exit(main())" --random-weights qwen3-8b --batch 1 --prompt-len 512 \
    --max-model-len 2048 --iters 30 --tree-budgets "" --spec ddtree --budget 32 --block-size 16 \
    $([ $q = fp8 ] && echo --draft-quantization fp8)
done
grep -h -A5 '"graph_ms"\|^plain\|^norm\|^glu' "$O"/qwen_*.log
