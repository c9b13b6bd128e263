"""Structured output against free decoding on one engine: tokens/s, τ and the constrained rounds'
host seconds (the candidates' read, the tree build), at batch 1 and 16, and whether every
constrained output equals plain constrained decoding's (spec none) at T = 0.

    python benchmarks/structured_bench.py [--model DIR] [--draft-model DIR] [--budget 32] [--max-tokens 128]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # this checkout's drafttree

from drafttree import LLM, SamplingParams
from drafttree.structured.params import StructuredOutputs

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "language": {"type": "string"}, "lines": {"type": "integer"},
    "steps": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "language", "lines", "steps"],
    "additionalProperties": False}
TASKS = ["quicksort", "binary search", "a linked list", "merge sort", "a hash map", "Dijkstra's algorithm",
         "a trie", "heap sort"]


def prompts(llm: LLM, n: int) -> list[str]:
    return [llm.apply_chat_template([{"role": "user", "content": f"Describe how to write {TASKS[i % len(TASKS)]} "
                                      f"in Python, as JSON with name, language, lines and steps."}])
            for i in range(n)]


def run(llm: LLM, texts: list[str], constrained: bool, max_tokens: int) -> dict:
    so = StructuredOutputs(json=SCHEMA) if constrained else None
    params = SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=so)
    llm.engine.constrained.reset()
    t0 = time.perf_counter()
    outs = llm.generate(texts, params)
    dt = time.perf_counter() - t0
    taus = [t for o in outs for t in o.metrics["accept_lengths"]]
    times = llm.engine.constrained.times
    return {"tok_s": sum(len(o.token_ids) for o in outs) / dt, "tau": sum(taus) / max(len(taus), 1),
            "constrained_rounds": times.rounds, "candidates_wait_ms_per_round": 1e3 * times.candidates_wait_s / max(times.rounds, 1),
            "tree_build_ms_per_round": 1e3 * times.tree_build_s / max(times.rounds, 1),
            "tokens": [o.token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--draft-model")
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,16")
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    spec = LLM(model=a.model, draft_model=a.draft_model, spec="ddtree", budget=a.budget, max_num_seqs=max(batches))
    plain = LLM(model=a.model, spec="none", max_num_seqs=max(batches))
    report = {}
    for B in batches:
        texts = prompts(spec, B)
        run(spec, texts, True, 8)   # warm both paths
        run(spec, texts, False, 8)
        free, con = run(spec, texts, False, a.max_tokens), run(spec, texts, True, a.max_tokens)
        ref = run(plain, texts, True, a.max_tokens)
        report[B] = {"free": {k: v for k, v in free.items() if k != "tokens"},
                     "schema": {k: v for k, v in con.items() if k != "tokens"},
                     "schema/free tok/s": con["tok_s"] / free["tok_s"],
                     "schema outputs equal spec none": con["tokens"] == ref["tokens"]}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
