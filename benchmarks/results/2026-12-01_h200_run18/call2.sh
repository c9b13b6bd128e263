#!/usr/bin/env bash
# Run 18, call 2: GPU tests at the merge inside the split launch (attention kernels; graphs
# against eager, PDL, fp32 speculation through the code's tiles); the one-token GEMV blocks of
# the SmolLM2-135M shape swept with weights from HBM (runs 9 and 14 swept them in L2) and the
# decode step with them. Carries the GGUF's second part.
# Usage: OUT=dir bash benchmarks/results/2026-12-01_h200_run18/call2.sh
set -uo pipefail
O=${OUT:-out}; mkdir -p "$O/logs"; L=$O/logs
export PYTHONPATH=.:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
cat .parts/g3.01 >> /tmp/gguf.asm; ls -l /tmp/gguf.asm
timeout 100 python3 -m pytest -q tests/test_attn_kernel.py > "$L/test_attn_kernel.log" 2>&1
tail -n 1 "$L/test_attn_kernel.log"
timeout 230 python3 -m pytest -q tests/test_cuda_graphs.py > "$L/test_cuda_graphs.log" 2>&1
tail -n 1 "$L/test_cuda_graphs.log"; grep -h "FAILED\|Error" "$L"/test_*.log | head -20
timeout 150 python3 benchmarks/gemv_bench.py --shape smollm2-135m --block-n 2,4,8,16 --block-k 128,256,512 \
  --warps 2,4 --out /tmp/smol1.json > "$L/smol1.txt" 2>&1
cp /tmp/smol1.json "$L/" 2>/dev/null; grep -h "torch ops (\|fastest\|Error" "$L/smol1.txt"
P="--batch 1 --prompt-len 512 --max-model-len 2048 --iters 30 --tree-budgets"
for b in code sweep; do
  e=(); [ $b = sweep ] && e=(DRAFTTREE_BLOCKS=/tmp/smol1.json)
  env "${e[@]}" timeout 60 python3 -m drafttree.bench.phases $P "" --random-weights smollm2-135m --spec none \
    --out "$L/smol_decode_$b.json" > "$L/smol_decode_$b.txt" 2>&1
  echo "smollm2 decode, $b blocks: $(grep -h '"decode"\|Error' "$L/smol_decode_$b.txt" | tail -1)"
done
tar czf "$O/logs.tgz" -C "$O" logs && rm -rf "$L"
