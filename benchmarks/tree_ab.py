#!/usr/bin/env python3
"""Two or more source trees side by side: `python -m drafttree.bench.phases` and `drafttree bench`
run from each tree in turn, repeat after repeat (tree A, tree B, tree A, ...), so a load that
drifts during the call falls on both. Each tree is a directory holding the `drafttree` package
(a checkout, or `git archive` of a commit).

    python benchmarks/tree_ab.py --tree before=/tmp/base --tree after=. --device cpu --reps 3 --out ab.json

Prints per tree the median and range of each figure: bench.phases' eager milliseconds of the round
and its pieces (and, on CUDA, the graphed round and decode step) and bench's tokens/s per method
and budget; writes every run and the summary to --out (JSON).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# bench.phases' eager figures under one name in every tree, first key found: where a tree's phase
# step holds several pieces (its "draft" step drafts and builds the tree, its "verify" step also
# accepts and commits) it times the forwards apart as draft_forward / verify_forward, which an
# older tree called "draft" / "verify". The context step's width differs between trees that bring
# the drafter's context up to date every round and those that catch up before a drafting round.
PHASE_KEYS = {"round": ("round",), "decode": ("decode",), "draft forward": ("draft_forward", "draft"),
              "tree build": ("tree_build",), "verify forward": ("verify_forward", "verify"),
              "accept commit": ("accept_commit",), "context": ("context",)}
GRAPH_KEYS = ("round", "decode")


def run(tree: Path, args: list[str], timeout: float) -> tuple[int, float, str]:
    # the tree first; what the caller put on the path (extra packages, the default model) stays after it
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p))
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, *args], cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    return p.returncode, time.perf_counter() - t0, (p.stdout + p.stderr)[-2000:]


def phases_job(a: argparse.Namespace, out: Path) -> list[str]:
    return ["-m", "drafttree.bench.phases", "--random-weights", a.model, "--spec", "ddtree", "--budget",
            str(a.budget), "--batch", "1", "--prompt-len", "128", "--iters", str(a.iters), "--device", a.device,
            "--tree-budgets", "", "--out", str(out)]


def bench_job(a: argparse.Namespace, out: Path) -> list[str]:
    return ["-m", "drafttree.cli", "bench", "--prompts", a.prompts, "--num-prompts", str(a.num_prompts),
            "--max-tokens", str(a.max_tokens), "--temperatures", "0", "--batch", "1", "--methods", "ar,ddtree",
            "--budgets", f"auto,{a.budget}", "--device", a.device, "--out", str(out)]


def figures(job: str, out: Path) -> dict[str, float]:
    if job == "phases":
        res = json.loads(out.read_text())
        eager, graph = res["eager_ms"], res.get("graph_ms", {})
        figs = {f"{name} ms": eager[next(k for k in keys if k in eager)] for name, keys in PHASE_KEYS.items()
                if any(k in eager for k in keys)}
        figs.update({f"graph {k} ms": graph[k] for k in GRAPH_KEYS if k in graph})
        return figs
    res = json.loads((out / "results.json").read_text())["results"]
    return {f"{r['method']}{'' if r.get('budget') is None else ' ' + str(r['budget'])} tok/s": r["tokens_per_s"]
            for r in res}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", action="append", required=True, metavar="NAME=DIR")
    p.add_argument("--jobs", default="phases,bench", help="of phases, bench")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default="smollm2-135m", help="bench.phases' random-weights shape")
    p.add_argument("--budget", type=int, default=8)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--prompts", default="humaneval", help="bench's --prompts")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default="tree_ab.json")
    a = p.parse_args(argv)
    trees = {}
    for t in a.tree:
        name, _, d = t.partition("=")
        trees[name] = Path(d).resolve()
        if not (trees[name] / "drafttree").is_dir():
            p.error(f"--tree {t}: no drafttree package in {trees[name]}")
    jobs = {"phases": phases_job, "bench": bench_job}
    wanted = [j for j in a.jobs.split(",") if j]
    for j in wanted:
        if j not in jobs:
            p.error(f"--jobs: unknown {j!r}; choose from {', '.join(jobs)}")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for job in wanted:
            for rep in range(a.reps):
                for name, tree in trees.items():
                    out = Path(tmp) / f"{job}_{name}_{rep}{'.json' if job == 'phases' else ''}"
                    rc, wall, tail = run(tree, jobs[job](a, out), a.timeout)
                    row = {"job": job, "tree": name, "rep": rep, "rc": rc, "wall_s": wall}
                    row.update(figures(job, out) if rc == 0 else {"error": tail})
                    runs.append(row)
                    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()
                                      if k != "error"}), flush=True)
    summary: dict = {}
    for r in runs:
        for k, v in r.items():
            if k in ("job", "tree", "rep", "rc", "wall_s", "error"):
                continue
            summary.setdefault(r["job"], {}).setdefault(k, {}).setdefault(r["tree"], []).append(v)
    print(f"\n{'figure':<22}" + "".join(f"{n:>28}" for n in trees))
    for job, figs in summary.items():
        for k, per_tree in figs.items():
            cells = []
            for n in trees:
                vs = per_tree.get(n, [])
                cells.append(f"{statistics.median(vs):9.2f} [{min(vs):.2f}-{max(vs):.2f}]" if vs else "-")
                per_tree[n] = {"median": statistics.median(vs), "min": min(vs), "max": max(vs), "runs": vs} if vs else None
            print(f"{k:<22}" + "".join(f"{c:>28}" for c in cells))
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "device": a.device, "trees": {n: str(t) for n, t in trees.items()},
            "args": vars(a)}
    Path(a.out).write_text(json.dumps({"meta": meta, "summary": summary, "runs": runs}, indent=1))
    print(f"wrote {a.out}")
    return 0 if all(r["rc"] == 0 for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
