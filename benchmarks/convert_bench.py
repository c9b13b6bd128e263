#!/usr/bin/env python3
"""The default model's GGUF conversion, step by step (reading the header, dequantizing, writing
the weights, converting the tokenizer) and as a whole, in a fresh process per run, several source
trees alternated run by run (`--tree before=/path --tree after=.`).
    python benchmarks/convert_bench.py --tree before=/tmp/before --tree after=. --reps 3 --out convert.json
Prints a table and writes every run to --out (JSON).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from tree_runs import run_in_tree

# run inside each tree: the converter's own steps, timed one after the other
STEPS = r"""
import json, sys, time, tempfile
from pathlib import Path
t0 = time.perf_counter()
import torch
from safetensors.torch import save_file
from drafttree.loader import gguf_convert as g
from drafttree.loader.default_model import default_gguf_path
times, path = {"imports": time.perf_counter() - t0}, default_gguf_path()
out = Path(tempfile.mkdtemp())
def step(name, fn):
    t = time.perf_counter(); r = fn(); times[name] = time.perf_counter() - t; return r
reader = step("header", lambda: g.open_gguf(path))
hp = step("hparams", lambda: g.read_llama_hparams(reader, path))
tensors = step("dequantize", lambda: g.convert_tensors(reader, hp, path, torch.bfloat16))
step("write weights", lambda: save_file(tensors, str(out / "model.safetensors")))
import inspect   # (a tree whose tokenizer step takes the header already read gets it)
header = [reader] if "header" in inspect.signature(g.write_tokenizer).parameters else []
step("tokenizer", lambda: g.write_tokenizer(path, out, hp, *header))
times["total"] = time.perf_counter() - t0
import transformers
print(json.dumps({**times, "transformers": transformers.__version__}))
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", action="append", default=[], metavar="NAME=DIR")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default="convert_bench.json")
    a = p.parse_args()
    trees = {k: Path(v).resolve() for k, v in (t.split("=", 1) for t in a.tree)} or {"here": Path(".").resolve()}
    runs = []
    for rep in range(a.reps):
        for name, tree in trees.items():
            times = run_in_tree(tree, STEPS)
            runs.append({"tree": name, "rep": rep, **times})
            print(f"{name:<8} rep {rep}  transformers {times.pop('transformers')}  "
                  + "  ".join(f"{k} {v:.2f}" for k, v in times.items()), flush=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
            "host": platform.node(), "cpus": os.cpu_count(), "trees": {k: str(v) for k, v in trees.items()}}
    Path(a.out).write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    steps = [k for k in runs[0] if k not in ("tree", "rep", "transformers")]
    print(f"\n{'tree':<8} " + " ".join(f"{s:>14}" for s in steps) + "   (median, min-max, s)")
    for name in trees:
        rs = [r for r in runs if r["tree"] == name]
        print(f"{name:<8} " + " ".join(f"{statistics.median(r[s] for r in rs):>5.2f} ({min(r[s] for r in rs):.2f}-"
                                       f"{max(r[s] for r in rs):.2f})" for s in steps))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
