#!/usr/bin/env bash
# Run 17, call 4: the SmolLM2-shape tiles swept again with cold weights (graph_timer now makes
# enough copies to exceed L2, one call per copy; calls 1-2 cycled 8 copies, which stayed in L2),
# at 33 rows with more pipeline stages; the DDTree and DFlash rounds (random weights) with the
# code's blocks, with every matrix's fastest tiles, and with the tiles only where they won.
# Usage: OUT=dir bash benchmarks/results/2026-12-01_h200_run17/call4.sh
set -uo pipefail
O=${OUT:-out}; mkdir -p "$O/logs"; L=$O/logs
export PYTHONPATH=.:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
timeout 260 python3 benchmarks/gemv_bench.py --shape smollm2-135m --rows 33 --block-n 32,64 --block-k 64,128 --warps 4 \
  --stages 2,4 --splits 1,2 --row-block 16,64 --out "$O/cold33.json" > "$L/cold33.txt" 2>&1
echo "rows 33, cold:"; grep -h "torch ops (\|fastest\|rows, one\|Error" "$L/cold33.txt"
phases_with() {   # MODE ARGS: drafttree.bench.phases with the sweep's blocks (all: every matrix; wins: where faster)
  timeout 60 python3 -c "import json, sys
from drafttree.models import gemm_kernel as g
for kind, numel, blocks, us, torch_us in json.load(open('$O/cold33.json')):
    g.set_blocks(kind, numel, blocks if '$1' == 'all' or us < torch_us else None, split=True)
print('few-row blocks', g.BLOCKS)
from drafttree.bench.phases import main; sys.exit(main())" "${@:2}"
}
P="--batch 1 --prompt-len 512 --max-model-len 2048 --iters 30 --random-weights smollm2-135m --tree-budgets"
for s in ddtree dflash; do
  extra="--block-size 16"; [ $s = ddtree ] && extra="--budget 32 --block-size 16"
  timeout 60 python3 -m drafttree.bench.phases $P "" --spec $s $extra > "$L/${s}_code.txt" 2>&1
  echo "$s code: $(grep -h '"round"\|Error' "$L/${s}_code.txt" | tail -1)"
  for mode in all wins; do
    phases_with $mode $P "" --spec $s $extra > "$L/${s}_$mode.txt" 2>&1
    echo "$s $mode: $(grep -h '"round"\|Error' "$L/${s}_$mode.txt" | tail -1)"
  done
done
tar czf "$O/logs.tgz" -C "$O" logs && rm -rf "$L"
