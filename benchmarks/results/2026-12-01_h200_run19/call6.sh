#!/usr/bin/env bash
# Run 19, call 6 (the split sums in each tile's last program, uncommitted on top of e2ec397): the
# few-row kernel tests on the GPU (the arrival counters' ordering is what the interpreter cannot
# check; fused layers at the code's blocks); then the SmolLM2-135M shape's DDTree round with the split sums in the last program
# (the code) and in a second launch (DRAFTTREE_GEMM_FIXUP=0), alternating, one process each.
# Usage: OUT=dir bash benchmarks/results/2026-12-01_h200_run19/call6.sh
set -uo pipefail
O=$(realpath -m "${OUT:-out}"); mkdir -p "$O/logs"; L=$O/logs
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
timeout 110 python3 -m pytest -q -p no:cacheprovider tests/test_gemv_kernel.py -k "last_program or layer" \
  > "$L/test_gemv.log" 2>&1
tail -n 1 "$L/test_gemv.log"; grep -h "FAILED\|Error" "$L/test_gemv.log" | head -5
P="--batch 1 --prompt-len 512 --max-model-len 2048 --iters 30 --tree-budgets"
for v in fix finish fix2 finish2; do
  f=1; case $v in finish*) f=0;; esac
  t=50; [ $v = fix ] && t=100   # the first process compiles the round's kernels
  DRAFTTREE_GEMM_FIXUP=$f timeout $t python3 -m drafttree.bench.phases $P "" --random-weights smollm2-135m \
    --spec ddtree --budget 32 --block-size 16 --out "$L/$v.json" > "$L/$v.txt" 2>&1
  echo "$v: $(grep -h '"draft_and\|"verify_acc\|"round"\|Error' "$L/$v.txt" | tail -3 | tr -s ' \n' ' ')"
done
tar czf "$O/logs.tgz" -C "$O" logs && rm -rf "$L"
