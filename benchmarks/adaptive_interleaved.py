"""Plain decoding against the per-round budget choice, interleaved prompt by prompt, so that a
shared machine's changing load falls on both alike (drafttree bench runs one method after the
other). Batch 1, the default pair unless --model/--draft-model; prints and writes JSON.

python benchmarks/adaptive_interleaved.py --device cpu --num-prompts 4 --max-tokens 64 --temperatures 0,1 \
    --repeats 2 --out results.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter

import torch

from drafttree import LLM, SamplingParams
from drafttree.bench.prompts import load_prompts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=None)
    p.add_argument("--draft-model", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--prompts", default="humaneval")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--budgets", default="auto", help="the speculative engines, e.g. auto,31")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    kw = dict(device=a.device, max_num_seqs=1, max_model_len=2048)
    t0 = time.perf_counter()
    engines = {"plain": LLM(model=a.model, spec="none", **kw)}
    startup = {}
    for b in a.budgets.split(","):
        t = time.perf_counter()
        engines[b] = LLM(model=a.model, draft_model=a.draft_model, spec="ddtree", budget=b, **kw)
        startup[b] = time.perf_counter() - t
    llm0 = engines["plain"]
    prompts = [llm0.apply_chat_template([{"role": "user", "content": q}])
               for q in load_prompts(a.prompts, a.num_prompts)]
    for e in engines.values():   # first calls per shape
        e.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4))
    results = []
    for T in (float(x) for x in a.temperatures.split(",")):
        secs = {k: [] for k in engines}
        toks = {k: 0 for k in engines}
        same = []
        hist = {k: Counter(e.engine.stats.budget_hist) for k, e in engines.items()}
        for r in range(a.repeats):
            for i, q in enumerate(prompts):
                sp = SamplingParams(temperature=T, seed=i, max_tokens=a.max_tokens, ignore_eos=True)
                outs = {}
                order = list(engines) if (r + i) % 2 == 0 else list(reversed(engines))
                for k in order:
                    t = time.perf_counter()
                    (o,) = engines[k].generate([q], sp)
                    secs[k].append(time.perf_counter() - t)
                    toks[k] += len(o.token_ids)
                    outs[k] = o.token_ids
                same.append(all(v == outs["plain"] for v in outs.values()))
        for k, e in engines.items():
            row = {"engine": k, "temperature": T, "tokens_per_s": toks[k] / sum(secs[k]),
                   "median_request_s": statistics.median(secs[k]),
                   "budget_histogram": {str(b): n for b, n in sorted((e.engine.stats.budget_hist - hist[k]).items())}}
            if k != "plain":
                row["speedup"] = row["tokens_per_s"] / (toks["plain"] / sum(secs["plain"]))
                row["startup_s"] = startup[k]
                row["cost_model_s"] = e.engine.costs.measure_s if e.engine.costs is not None else None
            results.append(row)
        results.append({"temperature": T, "outputs_equal_plain": sum(same) / len(same)})
    meta = {"date": time.strftime("%Y-%m-%d"), "device": a.device or ("cuda" if torch.cuda.is_available() else "cpu"),
            "threads": torch.get_num_threads(), "args": vars(a), "total_s": time.perf_counter() - t0}
    costs = {k: e.engine.costs.format() for k, e in engines.items() if e.engine.costs is not None}
    for r in results:
        print(json.dumps(r))
    for k, c in costs.items():
        print(f"[{k}]\n{c}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "results": results, "cost_models": costs}, f, indent=1)


if __name__ == "__main__":
    main()
