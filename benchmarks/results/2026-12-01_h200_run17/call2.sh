#!/usr/bin/env bash
# Run 17, call 2: the few-row tiles with token rows per program (a 33-row verify in programs of 16
# or 32 rows), swept for the SmolLM2-135M shape at 33 and 16 rows; the SmolLM2 shape's rounds
# (random weights) with each sweep's blocks against the code's (no tiles under 2^24 elements);
# the GPU tests of the few-row kernel.
# Usage: OUT=dir bash benchmarks/results/2026-12-01_h200_run17/call2.sh
set -uo pipefail
O=${OUT:-out}; mkdir -p "$O/logs"; L=$O/logs
export PYTHONPATH=.:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
S="benchmarks/gemv_bench.py --shape smollm2-135m --block-n 16,32,64 --block-k 64,128 --warps 4 --stages 2 --splits 1,2"
timeout 200 python3 $S --rows 33 --row-block 16,32 --out "$O/rows33.json" > "$L/rows33.txt" 2>&1
echo "rows 33:"; grep -h "torch ops (\|fastest\|rows, one\|Error" "$L/rows33.txt"
timeout 120 python3 $S --rows 16 --row-block 16 --out "$O/rows16.json" > "$L/rows16.txt" 2>&1
echo "rows 16:"; grep -h "torch ops (\|fastest\|rows, one\|Error" "$L/rows16.txt"
phases_with() {   # JSON MODE ARGS: drafttree.bench.phases with a sweep's blocks (MODE all: every matrix; wins: where faster)
  timeout 60 python3 -c "import json, sys
from drafttree.models import gemm_kernel as g
for kind, numel, blocks, us, torch_us in json.load(open('$1')):
    g.set_blocks(kind, numel, blocks if '$2' == 'all' or us < torch_us else None, split=True)
print('few-row blocks', g.BLOCKS)
from drafttree.bench.phases import main; sys.exit(main())" "${@:3}"
}
P="--batch 1 --prompt-len 512 --max-model-len 2048 --iters 30 --random-weights smollm2-135m --tree-budgets"
for s in ddtree dflash; do
  extra="--block-size 16"; [ $s = ddtree ] && extra="--budget 32 --block-size 16"
  timeout 60 python3 -m drafttree.bench.phases $P "" --spec $s $extra > "$L/${s}_code.txt" 2>&1
  echo "$s code:"; grep -h '"round\|draft_and\|verify_acc\|Error' "$L/${s}_code.txt" | tail -4
  for j in rows33 rows16; do for mode in all wins; do
    phases_with "$O/$j.json" $mode $P "" --spec $s $extra > "$L/${s}_${j}_$mode.txt" 2>&1
    echo "$s $j $mode:"; grep -h 'few-row\|"round\|draft_and\|verify_acc\|Error' "$L/${s}_${j}_$mode.txt" | tail -5
  done; done
done
timeout 200 python3 -m pytest -q tests/test_gemv_kernel.py -k "rows or prologue" > "$L/test_gemv.log" 2>&1; tail -2 "$L/test_gemv.log"
timeout 150 python3 -m pytest -q tests/test_cuda_graphs.py -k "fused" > "$L/test_graphs.log" 2>&1; tail -2 "$L/test_graphs.log"
tar czf "$O/logs.tgz" -C "$O" logs && rm -rf "$L"
