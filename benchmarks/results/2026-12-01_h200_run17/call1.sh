#!/usr/bin/env bash
# Run 17, call 1 (PDL on, the code's defaults): the few-row tiles swept for the SmolLM2-135M shape
# at 33 and 16 rows (its weights have no tiles yet); Qwen3-8B's QKV and gate/up tiles at 33 rows
# after a norm launch of their own (--prenormed) and with their prologue; the SmolLM2 shape's
# phases (random weights) before any change; a kernel profile of the Qwen3-8B DDTree round.
# Usage: OUT=dir bash benchmarks/results/2026-12-01_h200_run17/call1.sh
set -uo pipefail
O=${OUT:-out}; mkdir -p "$O/logs"; L=$O/logs
export PYTHONPATH=.:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
for r in 33 16; do
  timeout 150 python3 benchmarks/gemv_bench.py --shape smollm2-135m --rows $r --block-n 16,32,64 --block-k 64,128 \
    --warps 4 --stages 2 --splits 1,2 --out "$O/smollm2_rows$r.json" > "$L/smollm2_rows$r.txt" 2>&1
  echo "smollm2 rows $r:"; grep -h "torch ops (\|fastest\|rows, one\|Error" "$L/smollm2_rows$r.txt"
done
timeout 120 python3 benchmarks/gemv_bench.py --rows 33 --only qkv,gate_up --prenormed --block-n 64,128 --block-k 64,128 \
  --warps 4 --stages 3,4 --splits 1,2,4 --out "$O/qwen_prenormed33.json" > "$L/qwen_prenormed33.txt" 2>&1
echo "qwen3 prenormed rows 33:"; grep -h "torch ops (\|fastest\|rows, one\|Error" "$L/qwen_prenormed33.txt"
timeout 60 python3 benchmarks/gemv_bench.py --rows 33 --only qkv,gate_up --block-n 64,128 --block-k 64 \
  --warps 4 --stages 3 --splits 1,4 > "$L/qwen_fused33.txt" 2>&1
echo "qwen3 fused rows 33:"; grep -h "torch ops (\|fastest\|rows, one\|Error" "$L/qwen_fused33.txt"
P="--batch 1 --prompt-len 512 --max-model-len 2048 --iters 30 --random-weights smollm2-135m --tree-budgets"
for s in none ddtree dflash; do
  extra=""; [ $s = ddtree ] && extra="--budget 32 --block-size 16"; [ $s = dflash ] && extra="--block-size 16"
  timeout 60 python3 -m drafttree.bench.phases $P "" --spec $s $extra --out "$O/smollm2_$s.json" > "$L/smollm2_$s.txt" 2>&1
  echo "smollm2 $s:"; grep -h '"decode"\|"round\|draft_and\|verify_acc\|Error' "$L/smollm2_$s.txt" | tail -5
done
timeout 120 python3 benchmarks/profile_decode.py qwen3-8b ddtree > "$L/profile_qwen_ddtree.txt" 2>&1
grep -A34 "graphed rounds" "$L/profile_qwen_ddtree.txt" | cut -c1-92,150-175
timeout 60 python3 benchmarks/profile_decode.py smollm2-135m ddtree > "$L/profile_smollm2_ddtree.txt" 2>&1
tar czf "$O/logs.tgz" -C "$O" logs && rm -rf "$L"
