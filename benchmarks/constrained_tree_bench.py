"""The host's part of a constrained round, alone: `structured.tree.build_trees` over B rows at a
budget, from seeded random drafter candidates, on the default model's tokenizer and a JSON schema
after a reasoning the prompt opened, the rows grown along their matchers (the answer's grammar
and the reasoning alike) and inside the reasoning with its two masks (`Matcher.thought`). Then the masks alone
(`GrammarCompiler.fill_masks`) of 1, 4, 16 and 64 matchers in several JSON states, as it computes
them and through llguidance's thread pool on every call, for SERIAL_MASKS.

    python benchmarks/constrained_tree_bench.py [--rows 16] [--budget 32] [--repeats 10] [--out trees.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import llguidance
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # this checkout's drafttree

from drafttree.engine.text import load_tokenizer
from drafttree.loader.default_model import default_model_dir
from drafttree.structured.grammar import GrammarCompiler
from drafttree.structured.params import AfterReasoning, StructuredOutputs
from drafttree.structured.tree import build_trees

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "steps": {"type": "array",
                                                                                 "items": {"type": "string"}}},
          "required": ["name", "steps"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--depth", type=int, default=7, help="drafted positions (block size - 1)")
    ap.add_argument("--top-k", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=None, help="also write the figures (JSON) here")
    a = ap.parse_args()
    tok = load_tokenizer(default_model_dir())
    vocab = len(tok)
    eos = {tok.eos_token_id}
    compiler = GrammarCompiler(tok, vocab, eos)
    # any two special ids stand for the reasoning's markers: the grammar reads them as ids
    start, end = sorted(set(tok.all_special_ids) - eos)[:2]
    so = StructuredOutputs(json=SCHEMA, after_reasoning=AfterReasoning(start, end, True))
    rng = np.random.default_rng(0)
    B, D, K = a.rows, a.depth, a.top_k
    lp = np.log(rng.dirichlet(np.full(K, 0.3), size=(B, D))).astype(np.float32)
    lp = -np.sort(-lp, axis=-1)
    idx = rng.integers(100, vocab, size=(B, D, K))
    matchers = [compiler.matcher(so) for _ in range(B)]
    for m in matchers:
        m.advance(tok.encode("Let me think about the answer", add_special_tokens=False))
    report: dict = {"meta": {"date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv),
                             "rows": B, "budget": a.budget, "depth": D, "top_k": K, "vocab": vocab,
                             "repeats": a.repeats}}
    for name, rows in (("matchers", matchers), ("thought", [m.thought() for m in matchers])):
        args = (lp, idx, [0] * B, a.budget + 1, a.budget + 1, rows, False, compiler, eos)
        build_trees(*args)
        seconds, nodes = [], 0
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            trees = build_trees(*args)
            seconds.append(time.perf_counter() - t0)
            nodes = int(trees.valid[:, 1:].sum())
        ms = sorted(1e3 * s for s in seconds)
        report[name] = {"round_ms": {"median": ms[len(ms) // 2], "min": ms[0], "max": ms[-1]}, "nodes": nodes,
                        "us_per_node": 1e3 * ms[len(ms) // 2] / max(nodes, 1)}
        print(f"{name:9s} {ms[len(ms) // 2]:7.2f} ms a round ({ms[0]:.2f}-{ms[-1]:.2f}), {nodes} nodes, "
              f"{report[name]['us_per_node']:.1f} us a node")
    report["masks_us"] = masks(tok, compiler)
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))


MASK_STATES = {"object start": "", "key": '{"', "in a string": '{"name": "quick', "after a string": '{"name": "qs"',
               "in a number": '{"name": "q", "steps": [], "n": 1', "array start": '{"name": "q", "steps": ['}


def masks(tok, compiler: GrammarCompiler) -> dict:
    """Microseconds a fill_masks call of k matchers takes in each state: as the compiler fills
    them (serially up to SERIAL_MASKS) and through a thread pool of llguidance's default size."""
    so = StructuredOutputs(json={**SCHEMA, "properties": {**SCHEMA["properties"], "n": {"type": "integer"}}})
    pool = llguidance.LLExecutor()
    out: dict = {}
    for name, text in MASK_STATES.items():
        ms = [compiler.matcher(so) for _ in range(64)]
        for m in ms:
            m.advance(tok.encode(text, add_special_tokens=False))
        row = {}
        for k in (1, 4, 16, 64):
            buf = np.zeros((k, compiler.words), dtype=np.int32)
            jobs = [(m, i) for i, m in enumerate(ms[:k])]
            raw = [(m.m, i) for m, i in jobs]
            n = max(20, 2000 // k)
            row[k] = {"fill_masks": timed(lambda: compiler.fill_masks(jobs, buf), n),
                      "pool": timed(lambda: pool.unsafe_compute_mask_ptr(raw, buf.ctypes.data, compiler.words * 4, k), n)}
        out[name] = row
        print(f"{name:14s} " + " | ".join(f"{k}: {v['fill_masks']:.0f} / {v['pool']:.0f} us" for k, v in row.items()))
    return out


def timed(fn, n: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return 1e6 * (time.perf_counter() - t0) / n


if __name__ == "__main__":
    main()
