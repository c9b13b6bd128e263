#!/usr/bin/env bash
# One chunk of drafter training on one machine, each stage bounded in time: regenerate answers
# from the target into DATA for REGEN_S seconds (0: use what DATA holds), train from DRAFTER for
# TRAIN_S seconds (TRAIN_ARGS: more trainer flags, default "--loop-keep 2"; e.g. "--block-size 8
# --loop-keep 2" or "--grow-layers 5 --grow-intermediate 2048"; empty: none), then τ of
# the new and the old drafter (DFlash chain in every round, T = 0) on each evaluation prompt file.
# Variants on the same data: run again with another OUT, the same DATA and REGEN_S=0. SNAP=N: a
# snapshot every N steps, then τ of each on the first EVAL file (OUT/train/tau_curve.json, .png).
# CELLS: what τ is measured in (default "--methods dflash": the chain at T = 0), e.g. "--methods
# dflash,ddtree --budgets 8,32,128 --temperatures 0,1".
# Usage: OUT=dir PROMPTS=prompts_train.jsonl EVAL="heldout.jsonl:48 humaneval.jsonl:32" \
#        [DATA=$OUT/data] [TARGET=model.gguf] [DRAFTER=drafttree/assets/drafter-smollm2] \
#        [REGEN_S=150] [TRAIN_S=190] [TRAIN_ARGS="--loop-keep 2"] [SNAP=0] [ROWS=256 MAX_TOKENS=512 EVAL_ROWS=48] \
#        bash benchmarks/drafter_chunk.sh
# A run at batch 16 holds 40-55 GB of an H200 on this data: two fit side by side, three do not.
# The prompt files come from `drafttree train-drafter prompts --out DIR` (prompts_train.jsonl,
# prompts_heldout.jsonl) or any JSONL of {"prompt": ...}; HumanEval: drafttree.bench.prompts.
set -uo pipefail
OUT=${OUT:?}; PROMPTS=${PROMPTS:?}; EVAL=${EVAL:?}
DATA=${DATA:-$OUT/data}
DRAFTER=${DRAFTER:-drafttree/assets/drafter-smollm2}
TARGET_ARG=${TARGET:+--target $TARGET}
mkdir -p "$OUT" "$DATA"
t0=$(date +%s); step() { echo "== $(( $(date +%s) - t0 )) s: $*"; }
if [ "${REGEN_S:-150}" != 0 ]; then
  step "regenerate ${REGEN_S:-150} s into $DATA"
  python3 -m drafttree.cli train-drafter regenerate --out "$DATA" $TARGET_ARG --prompts "$PROMPTS" \
    --max-num-seqs ${ROWS:-256} --max-tokens ${MAX_TOKENS:-512} --max-prompt-tokens ${MAX_PROMPT_TOKENS:-1536} \
    --regen-time-limit ${REGEN_S:-150} --quiet > "$OUT/regen.log" 2>&1; echo "rc=$?"; tail -2 "$OUT/regen.log"
fi
step "train ${TRAIN_S:-190} s from $DRAFTER ${TRAIN_ARGS---loop-keep 2}"
python3 -m drafttree.cli train-drafter train --out "$OUT/train" --data "$DATA"/responses*.jsonl $TARGET_ARG \
  --init-from-drafter "$DRAFTER" ${TRAIN_ARGS---loop-keep 2} --batch-size 16 --lr ${LR:-3e-4} --epochs 100 --seed ${SEED:-5} \
  --train-time-limit ${TRAIN_S:-190} --snapshot-every ${SNAP:-0} --eval-num 0 --quiet > "$OUT/train.log" 2>&1
echo "rc=$?"; tail -2 "$OUT/train.log"
if [ "${SNAP:-0}" != 0 ]; then
  e=${EVAL%% *}; step "τ curve: every ${SNAP} steps on ${e%%:*}"
  python3 -m drafttree.cli train-drafter eval --out "$OUT/train" $TARGET_ARG --snapshots --max-num-seqs ${EVAL_ROWS:-48} \
    --no-cuda-graphs ${CELLS:---methods dflash} --eval-prompts "${e%%:*}" --eval-num "${e##*:}" --quiet 2>&1 | grep "τ ="
fi
for d in "$OUT/train/drafter" "$DRAFTER"; do
  for e in $EVAL; do
    step "τ of $d on ${e%%:*}"
    python3 -m drafttree.cli train-drafter eval --out "$OUT/eval" $TARGET_ARG --drafter "$d" \
      --max-num-seqs ${EVAL_ROWS:-48} --no-cuda-graphs ${CELLS:---methods dflash} --eval-prompts "${e%%:*}" \
      --eval-num "${e##*:}" --quiet \
      2>&1 | grep "τ ="
  done
done
step done
