#!/usr/bin/env bash
# The serving core's measure table: a warm `drafttree serve` per speculative method, loaded by
# `drafttree bench serve` at fixed concurrencies on chat prompts (128 tokens each), then a
# shared-system-prompt run (prefix-cache hit rate and the TTFT it saves, against the same load
# with prefix caching off). Start-up seconds per stage come from each server's log.
# Usage: OUT=dir DATASET_PATH=prompts.jsonl bash benchmarks/serve_load.sh
#   SPECS="ddtree dflash none"  CONCURRENCY="1 16 64 256"  NUM_PROMPTS=256  MAX_TOKENS=128
#   SERVE_ARGS=...   (extra server flags, e.g. --max-num-seqs 256)
#   WAIT_IDLE=1      (load each server only once the work it leaves for while idle is done, or
#                     IDLE_WAIT_S after its launch (default 900), said so, if that comes first)
set -euo pipefail
OUT=${OUT:-serve_load}
DATASET=${DATASET_PATH:+--dataset-path $DATASET_PATH}
DATASET=${DATASET:---dataset sharegpt-heldout}
SPECS=${SPECS:-"ddtree dflash none"}
CONCURRENCY=${CONCURRENCY:-"1 16 64 256"}
NUM_PROMPTS=${NUM_PROMPTS:-256}
MAX_TOKENS=${MAX_TOKENS:-128}
PORT=${PORT:-8123}
URL=http://127.0.0.1:$PORT
mkdir -p "$OUT"

serve() {  # name, flags...: start a server in the background and wait for /ready
  local name=$1; shift
  python3 -m drafttree.cli serve --port "$PORT" ${SERVE_ARGS:-} "$@" > "$OUT/$name.server.log" 2>&1 &
  SERVER=$!
  local t0=$SECONDS
  for _ in $(seq 600); do
    curl -sf "$URL/ready" > /dev/null && break
    kill -0 "$SERVER" 2> /dev/null || { echo "$name: server exited"; tail -20 "$OUT/$name.server.log"; return 1; }
    sleep 1
  done
  curl -sf "$URL/ready" > /dev/null || { echo "$name: not ready after 600 s"; return 1; }
  echo "$name: ready after $(( SECONDS - t0 )) s"
  [ "${WAIT_IDLE:-0}" = 1 ] || return 0
  local limit=$(( t0 + ${IDLE_WAIT_S:-900} )) left="?"
  while [ "$SECONDS" -lt "$limit" ]; do   # the graphs and compiles left for while idle (defer_graphs)
    left=$(curl -sf "$URL/metrics" | awk '/^drafttree_cuda_graph_sets_pending /{print int($2)}') || left="?"
    [ "$left" = 0 ] && { echo "$name: idle work done after $(( SECONDS - t0 )) s"; return 0; }
    sleep 1
  done
  echo "$name: idle work NOT done after $(( SECONDS - t0 )) s ($left pieces left): the load below ran meanwhile"
}

stop() { kill "$SERVER" 2> /dev/null || true; wait "$SERVER" 2> /dev/null || true; }
trap stop EXIT

load() {  # out-dir, bench-serve flags...
  local dir=$1; shift
  python3 -m drafttree.cli bench serve --base-url "$URL" $DATASET --max-tokens "$MAX_TOKENS" \
    --ignore-eos --out "$OUT/$dir" "$@" 2>&1 | tail -n 12
  curl -s "$URL/metrics" | grep -E '^drafttree_(prefix_cache|preemptions|kv_free_pages|startup_seconds)' \
    > "$OUT/$dir/metrics.txt" || true
}

first=${SPECS%% *}
for spec in $SPECS; do
  serve "$spec" --spec "$spec"
  grep "start-up:" "$OUT/$spec.server.log" || true
  for c in $CONCURRENCY; do
    n=$(( c * 4 > NUM_PROMPTS ? c * 4 : NUM_PROMPTS ))
    echo "== $spec, concurrency $c, $n requests"
    load "$spec/c$c" --max-concurrency "$c" --num-prompts "$n"
  done
  if [ "$spec" = "$first" ] && [ "${SHARED:-1}" = 1 ]; then   # the shared system prompt, with and without prefix caching
    echo "== $spec, shared prefix of 512 words, concurrency 16"
    load "$spec/shared512" --max-concurrency 16 --num-prompts 128 --shared-prefix-len 512
    stop
    serve "${first}_nocache" --spec "$first" --no-prefix-caching
    echo "== $first without prefix caching, shared prefix of 512 words, concurrency 16"
    load "$first/shared512_nocache" --max-concurrency 16 --num-prompts 128 --shared-prefix-len 512
  fi
  stop
done
