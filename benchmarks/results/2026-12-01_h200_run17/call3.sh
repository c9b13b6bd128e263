#!/usr/bin/env bash
# Run 17, call 3: why call 2's SmolLM2-shape tiles, faster per matrix, made the graphed round
# slower. The DDTree round (random weights) with the code's blocks and with the 16-row sweep's
# winners, each with PDL on (mode 2) and off; kernel profiles of both with PDL off (under PDL a
# kernel's profiled time includes its wait for the kernel before) and of the tiles with PDL on.
# Usage: OUT=dir bash benchmarks/results/2026-12-01_h200_run17/call3.sh
set -uo pipefail
O=${OUT:-out}; mkdir -p "$O/logs"; L=$O/logs
export PYTHONPATH=.:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
BLOCKS="$(dirname "$0")/2_row_blocks_warm_sweeps/rows16.json"   # as run: a copy of call 2's rows16.json
with_tiles() {   # SCRIPT ARGS: run SCRIPT (a module's main or a benchmark file) with the 16-row sweep's winners
  timeout 90 python3 -c "import json, runpy, sys
from drafttree.models import gemm_kernel as g
for kind, numel, blocks, us, torch_us in json.load(open('$BLOCKS')):
    g.set_blocks(kind, numel, blocks if us < torch_us else None, split=True)
print('few-row blocks', g.BLOCKS)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name='__main__') if sys.argv[0].endswith('.py') else runpy.run_module(sys.argv[0], run_name='__main__')" "$@"
}
P="--batch 1 --prompt-len 512 --max-model-len 2048 --iters 30 --random-weights smollm2-135m --tree-budgets '' --spec ddtree --budget 32 --block-size 16"
for pdl in 2 0; do
  eval DRAFTTREE_PDL=$pdl timeout 60 python3 -m drafttree.bench.phases $P > "$L/code_pdl$pdl.txt" 2>&1
  echo "code PDL $pdl: $(grep -h '"round"\|Error' "$L/code_pdl$pdl.txt" | tail -1)"
  eval DRAFTTREE_PDL=$pdl with_tiles drafttree.bench.phases $P > "$L/tiles_pdl$pdl.txt" 2>&1
  echo "tiles PDL $pdl: $(grep -h '"round"\|Error' "$L/tiles_pdl$pdl.txt" | tail -1)"
done
DRAFTTREE_PDL=0 timeout 90 python3 benchmarks/profile_decode.py smollm2-135m ddtree > "$L/profile_code_pdl0.txt" 2>&1
DRAFTTREE_PDL=0 with_tiles benchmarks/profile_decode.py smollm2-135m ddtree > "$L/profile_tiles_pdl0.txt" 2>&1
DRAFTTREE_PDL=2 with_tiles benchmarks/profile_decode.py smollm2-135m ddtree > "$L/profile_tiles_pdl2.txt" 2>&1
for f in profile_code_pdl0 profile_tiles_pdl0; do echo "== $f"; grep -A22 "graphed rounds" "$L/$f.txt" | cut -c1-70,150-175,200-230; grep "CUDA time total" "$L/$f.txt"; done
tar czf "$O/logs.tgz" -C "$O" logs && rm -rf "$L"
