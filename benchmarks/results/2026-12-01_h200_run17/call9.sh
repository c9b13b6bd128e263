#!/usr/bin/env bash
# Run 17, call 9: call 8's new lossless test, mended to send fp32 rows through the fused kernels
# (the engine sends only 16-bit rows there, so in call 8 no tile ran and the test failed on that).
# Usage: OUT=dir bash benchmarks/results/2026-12-01_h200_run17/call9.sh
set -uo pipefail
O=${OUT:-out}; mkdir -p "$O"
export PYTHONPATH=.:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
timeout 110 python3 -m pytest -q tests/test_cuda_graphs.py -k fp32_graphed > "$O/test_lossless.log" 2>&1
tail -3 "$O/test_lossless.log"
