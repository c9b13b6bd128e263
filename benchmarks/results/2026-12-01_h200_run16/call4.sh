#!/usr/bin/env bash
# Run 16, call 4, at the PDL defaults (mode 2; the o and down projections' two steps before the
# wait): the GPU tests of every kernel file PDL touched and of graphs against eager. Also starts
# the default pair's GGUF: the first of three parts, appended to /tmp/gguf.asm.
# Usage: OUT=dir bash benchmarks/results/2026-12-01_h200_run16/call4.sh
set -uo pipefail
O=${OUT:-out}; mkdir -p "$O/logs"; L=$O/logs
export PYTHONPATH=.:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
rm -f /tmp/gguf.asm; cat .parts/g3.00 >> /tmp/gguf.asm; ls -l /tmp/gguf.asm
for f in test_cuda_graphs test_attn_kernel test_gemv_kernel; do
  timeout 170 python3 -m pytest tests/$f.py -q -p no:cacheprovider > "$L/$f.log" 2>&1
  echo "$f: $(tail -n 1 "$L/$f.log")"; grep -h "^FAILED" "$L/$f.log" | head -5
done
tar czf "$O/logs.tgz" -C "$O" logs && rm -rf "$L"
