#!/usr/bin/env bash
# Run 19, call 4 (overlapped rounds, uncommitted on top of 233c9dd): the overlap tests on CUDA;
# plain decoding and DDTree B = 32 on the SmolLM2-135M shape with random weights (and a random
# drafter), 8 random 128-token prompts, 256 tokens, T = 0, overlap on (the default) and off,
# alternating, one process each; the Qwen3-8B shape's decode step and DDTree round at this code.
# Usage: OUT=dir bash benchmarks/results/2026-12-01_h200_run19/call4.sh
set -uo pipefail
O=$(realpath -m "${OUT:-out}"); mkdir -p "$O/logs"; L=$O/logs
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_overlap.py > "$L/test_overlap.log" 2>&1
tail -n 1 "$L/test_overlap.log"; grep -h "FAILED\|Error" "$L/test_overlap.log" | head -5
B="python3 -m drafttree.cli bench --random-weights smollm2-135m --methods ar,ddtree --budgets 32 --temperatures 0 --num-prompts 8 --max-tokens 256"
for i in 1 2; do
  for v in on off; do
    flag=""; [ $v = off ] && flag=--no-overlap
    timeout 100 $B $flag --out "$L/smol_${v}_$i" > "$L/smol_${v}_$i.log" 2>&1
    echo "overlap $v $i:"; grep -hv "bench:\|capturing\|wrote" "$L/smol_${v}_$i.log" | tail -n 3
  done
done
timeout 150 python3 -m drafttree.bench.phases --batch 1 --prompt-len 512 --max-model-len 2048 --iters 30 --tree-budgets "" \
  --random-weights qwen3-8b --spec ddtree --budget 32 --block-size 16 --out "$L/qwen3.json" > "$L/qwen3.txt" 2>&1
grep -h '"decode\|"draft_and\|"verify_acc\|"round"\|Error' "$L/qwen3.txt" | tail -6
tar czf "$O/logs.tgz" -C "$O" logs && rm -rf "$L"
