#!/usr/bin/env bash
# Run 19, call 3b (233c9dd; the machine of call 3, its GGUF and wheels still under /tmp/site):
# the default pair at batch 1 without the host profiler (plain, DFlash, DDTree B = 8 and 32) and
# at batch 4 (plain, DDTree B = 32).
# Usage: OUT=dir bash benchmarks/results/2026-12-01_h200_run19/call3b.sh
set -uo pipefail
O=$(realpath -m "${OUT:-out}"); mkdir -p "$O"
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
B="python3 -m drafttree.cli bench --prompts humaneval --max-tokens 256 --temperatures 0 --num-prompts 32"
timeout 200 $B --methods ar,dflash,ddtree --budgets 8,32 --out "$O/b1" > "$O/b1.log" 2>&1
grep -hv "bench:\|capturing\|transformers" "$O/b1.log" | tail -n 7
timeout 150 $B --batch 4 --methods ar,ddtree --budgets 32 --out "$O/b4" > "$O/b4.log" 2>&1
grep -hv "bench:\|capturing\|transformers" "$O/b4.log" | tail -n 4
