"""Structured output against free decoding on one engine: tokens/s, τ and the constrained rounds'
host seconds (the candidates' read, the tree build), at each batch size, free and schema runs
alternated --repeats times (the ratio's median and spread), and whether every constrained output
equals plain constrained decoding's (spec none) at T = 0: on a GPU by a second pair of engines in
deterministic mode (bf16 kernels of other widths may round a near-tie the other way; deterministic
mode is where speculative decoding gives plain decoding's bits), on a CPU (fp32) by the timed engine.
The schema asks for at least MIN_STEPS steps, so a constrained answer runs to --max-tokens as a free
one does and the two rates are of equally long outputs.

    python benchmarks/structured_bench.py [--model DIR] [--draft-model DIR] [--budget 32|auto] [--max-tokens 128]
        [--batches 1,16] [--schema-rows K] [--repeats 3] [--device cpu|cuda] [--out structured.json]

--schema-rows K: the schema runs constrain the first K requests of each batch only (a batch mixing
JSON and free requests); the default, all of them.
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

MIN_STEPS = 24
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "language": {"type": "string"}, "lines": {"type": "integer"},
    "steps": {"type": "array", "items": {"type": "string"}, "minItems": MIN_STEPS}},
    "required": ["name", "language", "lines", "steps"],
    "additionalProperties": False}
TASKS = ["quicksort", "binary search", "a linked list", "merge sort", "a hash map", "Dijkstra's algorithm",
         "a trie", "heap sort"]


def prompts(llm: LLM, n: int) -> list[str]:
    return [llm.apply_chat_template([{"role": "user", "content": f"Describe how to write {TASKS[i % len(TASKS)]} "
                                      f"in Python, as JSON with name, language, lines and steps."}])
            for i in range(n)]


def run(llm: LLM, texts: list[str], constrained: bool, max_tokens: int, schema_rows: int | None = None) -> dict:
    """Free, or the schema on the first `schema_rows` requests (None: all) and the others free."""
    so = StructuredOutputs(json=SCHEMA) if constrained else None
    k = len(texts) if schema_rows is None else schema_rows
    params = [SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=so if i < k else None)
              for i in range(len(texts))]
    llm.engine.constrained.reset()
    hist = dict(llm.engine.book.counts.budget_hist)
    before = llm.engine.stats
    t0 = time.perf_counter()
    outs = llm.generate(texts, params)
    dt = time.perf_counter() - t0
    after = llm.engine.stats
    # the device's seconds per phase (CUDA events; the CPU's own), against the run's wall time
    phases = {k: round(1e3 * (v - before.phase_seconds.get(k, 0.0)), 3) for k, v in after.phase_seconds.items()
              if v > before.phase_seconds.get(k, 0.0)}
    rounds = {str(b): n - hist.get(b, 0) for b, n in sorted(llm.engine.book.counts.budget_hist.items())
              if n > hist.get(b, 0)}
    taus = [t for o in outs for t in o.metrics["accept_lengths"]]
    times = llm.engine.constrained.times
    return {"tok_s": sum(len(o.token_ids) for o in outs) / dt, "tau": sum(taus) / max(len(taus), 1),
            "constrained_rounds": times.rounds, "candidates_wait_ms_per_round": 1e3 * times.candidates_wait_s / max(times.rounds, 1),
            "tree_build_ms_per_round": 1e3 * times.tree_build_s / max(times.rounds, 1),
            "tree_build_us_per_node": 1e6 * times.tree_build_s / max(times.tree_nodes, 1), "rounds_per_budget": rounds,
            "drafted_ahead": times.drafted_ahead, "decode_masks_ms": 1e3 * times.decode_masks_s,
            "graph_fallbacks": after.graph_fallbacks - before.graph_fallbacks, "wall_ms": 1e3 * dt,
            "device_ms_per_phase": phases,
            "tokens": [o.token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--draft-model")
    ap.add_argument("--budget", default="32", help="DDTree's budget, or auto (the per-round choice)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--schema-rows", type=int, default=None, help="constrain only the first K requests of a batch")
    ap.add_argument("--repeats", type=int, default=3, help="free and schema runs, alternated")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=None, help="also write the report (JSON) here")
    a = ap.parse_args()
    if a.repeats < 1:
        ap.error("--repeats must be >= 1")
    batches = [int(b) for b in a.batches.split(",")]
    common = dict(max_num_seqs=max(batches), **({"device": a.device} if a.device else {}))
    budget = None if a.budget == "auto" else int(a.budget)
    # the timed engine captures what its rounds replay (no processed rounds here); the engines that
    # only check outputs run eagerly (in deterministic mode graphs replay what eager rounds run),
    # which spares three engines' captures
    spec = LLM(model=a.model, draft_model=a.draft_model, spec="ddtree", budget=budget, processed_graphs=False,
               **common)
    common = dict(common, cuda_graphs=False)
    plain = LLM(model=a.model, spec="none", **common)
    checks = (spec, plain)
    if spec.engine.runner.device.type == "cuda":
        det = dict(common, deterministic=True)
        checks = (LLM(model=a.model, draft_model=a.draft_model, spec="ddtree", budget=budget, **det),
                  LLM(model=a.model, spec="none", **det))
    report: dict = {"meta": {"date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv),
                             "device": spec.engine.runner.device.type, "budget": a.budget,
                             "max_tokens": a.max_tokens, "repeats": a.repeats, "schema_rows": a.schema_rows,
                             "schema": SCHEMA}}
    if spec.engine.runner.device.type == "cuda":
        import torch
        report["meta"]["gpu"] = torch.cuda.get_device_name()
    for B in batches:
        texts = prompts(spec, B)
        k = a.schema_rows
        run(spec, texts, True, 8, k)   # warm both paths
        run(spec, texts, False, 8)
        free, con = [], []
        for _ in range(a.repeats):
            free.append(run(spec, texts, False, a.max_tokens))
            con.append(run(spec, texts, True, a.max_tokens, k))
        ref = run(plain, texts, True, a.max_tokens, k)
        same = all(c["tokens"] == ref["tokens"] for c in con)
        if checks[0] is not spec:   # the timed engines' own comparison, kept for what it shows
            got, want = (run(llm, texts, True, a.max_tokens, k) for llm in checks)
            same_det = got["tokens"] == want["tokens"]
        else:
            same_det = same
        ratios = sorted(c["tok_s"] / f["tok_s"] for f, c in zip(free, con))
        report[str(B)] = {"free": [{k: v for k, v in f.items() if k != "tokens"} for f in free],
                          "schema": [{k: v for k, v in c.items() if k != "tokens"} for c in con],
                          "schema/free tok/s": {"median": ratios[len(ratios) // 2], "min": ratios[0],
                                                "max": ratios[-1]},
                          "tau free": [f["tau"] for f in free], "tau schema": [c["tau"] for c in con],
                          "tokens free / schema": [sum(map(len, f["tokens"])) for f in free[:1]] +
                                                  [sum(map(len, c["tokens"])) for c in con[:1]],
                          "schema outputs equal spec none": same_det,
                          "schema outputs equal spec none, timed engines": same}
        if a.out:   # after each batch: a run cut short keeps what it measured
            Path(a.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
