"""What a plain round costs in an engine with a drafter against one in a plain engine: the same
prompts decoded by `--spec none` and by DDTree whose every round is forced plain (budget 0),
alternated repeat by repeat, so that a shared machine's load falls on both alike. Per round: wall
seconds outside prefill, device seconds by phase (CUDA events; on the CPU the host clock around
each eager phase), the host's seconds between rounds (their difference), the phases a round ran,
and the first token's seconds; with --host-profile the host functions that differ.

python benchmarks/plain_round_cost.py --device cpu --num-prompts 4 --max-tokens 64 --repeats 3 --out plain.json
python benchmarks/plain_round_cost.py --num-prompts 16 --batch 1,16 --max-tokens 256 --repeats 5   # a GPU
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time

import torch

from drafttree import LLM, SamplingParams
from drafttree.bench.prompts import load_prompts


def forced_plain(llm: LLM) -> None:
    """Every round of this engine's chooser decodes plainly (budget 0), counted as the cost model's."""
    llm.engine.chooser.choose = lambda bucket, allowed, rows, cap=None, extra=(), host_rows=0: 0


def run(llm: LLM, prompts: list, params: list[SamplingParams], profile: cProfile.Profile | None) -> dict:
    eng = llm.engine
    eng.reset_stats()
    t0 = time.perf_counter()
    if profile is not None:
        profile.enable()
    outs = llm.generate(prompts, params, use_tqdm=False)
    if profile is not None:
        profile.disable()
    wall = time.perf_counter() - t0
    st = eng.stats
    rounds = max(st.rounds, 1)
    phases = {k: v for k, v in st.phase_seconds.items() if k != "prefill"}
    device = sum(phases.values())
    outside = wall - st.prefill_seconds
    return {"wall_s": wall, "rounds": st.rounds, "tokens": sum(len(o.token_ids) for o in outs),
            "round_ms": 1e3 * outside / rounds, "device_ms": 1e3 * device / rounds,
            "host_ms": 1e3 * (outside - device) / rounds,
            "phase_ms": {k: 1e3 * v / rounds for k, v in sorted(phases.items())},
            "phase_seconds": dict(st.phase_seconds),
            "prefill_ms": 1e3 * st.prefill_seconds / max(len(outs), 1),
            "ttft_ms": 1e3 * statistics.mean(o.metrics["ttft_s"] for o in outs),
            "budget_histogram": {str(k): v for k, v in sorted(st.budget_hist.items())},
            "token_ids": [o.token_ids for o in outs]}


def step_times(engines: dict[str, LLM], sizes: list[int], repeats: int) -> list[dict]:
    """Each engine's decode step, and the drafter's context write, timed alone through the
    runner's timing routine (graph replays where captured), alternated engine by engine."""
    from drafttree.phases import Phase
    from drafttree.runner.phase_table import step
    from drafttree.sampling import SampleMode
    out = []
    for B in sizes:
        times: dict[str, list[float]] = {}
        for r in range(repeats):
            for k in (list(engines) if r % 2 == 0 else list(reversed(engines))):
                run = engines[k].engine.runner
                bucket = run.cache_cfg.batch_bucket(B)
                kv = run.graphs.kv_lengths[0] if run.graphs is not None else run.round_kv_len(64)
                phases = [Phase.DECODE] + ([Phase.CONTEXT] if run.drafter is not None else [])
                saved = run.state.snapshot()
                for ph in phases:
                    st = step(run.spec, ph, bucket)
                    times.setdefault(f"{k} {ph.value} x{st.width}", []).extend(
                        run.time_runs(st, bucket, SampleMode.SAMPLE, kv, 5))
                run.state.restore(saved)
        out.append({"batch": B, "ms": {k: 1e3 * statistics.median(v) for k, v in times.items()},
                    "spread_ms": {k: [1e3 * min(v), 1e3 * max(v)] for k, v in times.items()}})
        print(json.dumps(out[-1]))
    return out


def top_functions(profile: cProfile.Profile, n: int = 25) -> str:
    s = io.StringIO()
    pstats.Stats(profile, stream=s).sort_stats("tottime").print_stats(n)
    return s.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=None)
    p.add_argument("--draft-model", default=None)
    p.add_argument("--random-weights", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--prompts", default="sharegpt-heldout")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--batch", default="1", help="batch sizes, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--host-profile", action="store_true", help="cProfile each engine's rounds (slows the host)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    sizes = [int(b) for b in a.batch.split(",")]
    kw = dict(device=a.device, dtype=a.dtype, max_num_seqs=max(sizes), max_model_len=2048,
              random_weights=a.random_weights)
    kw = {k: v for k, v in kw.items() if v is not None}
    engines = {"plain": LLM(model=a.model, spec="none", **kw),
               "drafter": LLM(model=a.model, draft_model=a.draft_model, spec="ddtree", budget="auto", **kw)}
    forced_plain(engines["drafter"])
    vocab = engines["plain"].engine.model_cfg.vocab_size if a.random_weights else None
    texts = load_prompts(a.prompts, a.num_prompts, random_vocab=vocab)
    llm0 = engines["plain"]
    prompts = [q if isinstance(q, list) or llm0.tokenizer is None
               else llm0.apply_chat_template([{"role": "user", "content": q}]) for q in texts]
    for e in engines.values():   # first calls per shape
        for B in sizes:
            e.generate(prompts[:B], SamplingParams(temperature=a.temperature, seed=0, max_tokens=4), use_tqdm=False)
    steps = step_times(engines, sizes, a.repeats)
    profiles = {k: cProfile.Profile() for k in engines} if a.host_profile else {}
    cells = []
    for B in sizes:
        runs: dict[str, list[dict]] = {k: [] for k in engines}
        for r in range(a.repeats):
            order = list(engines) if r % 2 == 0 else list(reversed(engines))
            for k in order:
                for i in range(0, len(prompts), B):
                    sp = [SamplingParams(temperature=a.temperature, seed=j, max_tokens=a.max_tokens, ignore_eos=True)
                          for j in range(i, min(i + B, len(prompts)))]
                    runs[k].append(run(engines[k], prompts[i:i + B], sp, profiles.get(k)))
        same = all(x["token_ids"] == y["token_ids"] for x, y in zip(runs["plain"], runs["drafter"]))
        cell = {"batch": B, "temperature": a.temperature, "outputs_equal": same}
        for k, rs in runs.items():
            cell[k] = {m: statistics.median(r[m] for r in rs) for m in
                       ("round_ms", "device_ms", "host_ms", "ttft_ms", "prefill_ms")}
            cell[k]["spread_round_ms"] = [min(r["round_ms"] for r in rs), max(r["round_ms"] for r in rs)]
            names = sorted({n for r in rs for n in r["phase_ms"]})
            cell[k]["phase_ms"] = {n: statistics.median(r["phase_ms"].get(n, 0.0) for r in rs) for n in names}
            cell[k]["phase_rounds"] = {n: sum(1 for r in rs if n in r["phase_ms"]) for n in names}
            cell[k]["budget_histogram"] = rs[-1]["budget_histogram"]
            cell[k]["runs"] = [{m: v for m, v in r.items() if m != "token_ids"} for r in rs]
        for m in ("round_ms", "device_ms", "host_ms", "ttft_ms"):
            cell[f"{m}_ratio"] = cell["drafter"][m] / max(cell["plain"][m], 1e-9)
        cells.append(cell)
        print(json.dumps({k: v for k, v in cell.items() if k not in ("plain", "drafter")}))
        for k in engines:
            c = cell[k]
            phases = json.dumps({n: round(v, 4) for n, v in c['phase_ms'].items()})
            print(f"  {k:<8} round {c['round_ms']:.3f} ms (spread {c['spread_round_ms'][0]:.3f}-"
                  f"{c['spread_round_ms'][1]:.3f}), device {c['device_ms']:.3f}, host {c['host_ms']:.3f}, "
                  f"first token {c['ttft_ms']:.2f}, phases {phases}")
    meta = {"date": time.strftime("%Y-%m-%d"), "device": str(engines["plain"].engine.device),
            "threads": torch.get_num_threads(), "args": vars(a)}
    if profiles:
        for k, prof in profiles.items():
            print(f"[{k} host profile]\n{top_functions(prof)}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "steps": steps, "cells": cells,
                       "profiles": {k: top_functions(v) for k, v in profiles.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
