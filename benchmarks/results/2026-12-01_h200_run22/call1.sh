#!/usr/bin/env bash
# Run 22, call 1 (carries the GGUF's first half; the drafter is left out of the tree so that half
# fits): the kernel GPU tests not run whole since run 19 (fused ops, tree, tree kernel).
# Parts: split -n 2 -d <the GGUF> .parts/gh. ; xz -9 the training prompts into .parts/ (call 2).
# Drafter out of the copied tree for calls 1-2: git rm -q --cached drafttree/assets/drafter-smollm2/model.safetensors,
# and ignore that path; `git reset -q` it before call 3.
# Usage: OUT=dir bash benchmarks/results/2026-12-01_h200_run22/call1.sh
set -uo pipefail
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/machine.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/machine.txt"
rm -f /tmp/gguf.asm; cp .parts/gh.00 /tmp/gguf.asm; ls -la /tmp/gguf.asm
timeout ${LIMIT:-240} python3 -m pytest -q -p no:cacheprovider -rf tests/test_tree_kernel.py tests/test_tree.py \
  tests/test_fused.py > "$OUT/tests.log" 2>&1
tail -n 2 "$OUT/tests.log"; grep -h "FAILED" "$OUT/tests.log" | head
