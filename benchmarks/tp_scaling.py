"""Tensor-parallel scaling of the phases: for each random-weight shape, batch and tensor-parallel
size, one `python -m drafttree.bench.phases` run (a fresh process each, so every run has the GPUs
to itself), then a table: the graphed decode step, its collectives' share (the step's all-reduces
and all-gather timed alone, as one graph), the graphed DDTree round, and the round in decode steps.

    python benchmarks/tp_scaling.py [--shapes qwen3-8b,qwen3-32b] [--batches 1,16] [--tp 1,2,4]
                                    [--budget 32] [--out tp_scaling]        (CUDA; sizes past the GPUs are skipped)

Aims: a TP=2 decode step at most 0.6x the TP=1 step; the round in decode steps no worse
than at TP=1 plus 0.1.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch


def run(shape: str, batch: int, tp: int, budget: int, out: Path) -> dict | None:
    path = out / f"{shape}_b{batch}_tp{tp}.json"
    cmd = [sys.executable, "-m", "drafttree.bench.phases", "--random-weights", shape, "--spec", "ddtree",
           "--budget", str(budget), "--batch", str(batch), "--tensor-parallel-size", str(tp), "--tree-budgets", "",
           "--out", str(path)]
    print(" ".join(cmd), flush=True)
    r = subprocess.run(cmd, stdout=subprocess.DEVNULL)
    return json.loads(path.read_text()) if r.returncode == 0 and path.is_file() else None


def row(res: dict | None, shape: str, batch: int, tp: int, base: dict | None) -> str:
    if res is None:
        return f"| {shape} | {batch} | {tp} | failed | | | | | |"
    g = res["graph_ms"]
    ratio = f"{g['decode'] / base['graph_ms']['decode']:.2f}x" if base else ""
    share = f"{100 * g.get('collectives_share', 0.0):.1f} %"
    return (f"| {shape} | {batch} | {tp} | {g['decode']:.3f} | {ratio} | {share} | {g['round']:.3f} | "
            f"{g['round_in_decode_steps']:.2f} | {res['kv_len']} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qwen3-8b,qwen3-32b")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--tp", default="1,2,4")
    p.add_argument("--budget", type=int, default=32)
    p.add_argument("--out", default="tp_scaling")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    gpus = torch.cuda.device_count()
    lines = ["| shape | batch | TP | decode ms (graphed) | vs TP=1 | collectives | DDTree round ms | round / decode "
             "| KV length |", "|---|---|---|---|---|---|---|---|---|"]
    for shape in a.shapes.split(","):
        for batch in (int(b) for b in a.batches.split(",")):
            base = None
            for tp in (int(t) for t in a.tp.split(",")):
                if tp > gpus:
                    print(f"skipping TP={tp}: {gpus} GPUs", flush=True)
                    continue
                res = run(shape, batch, tp, a.budget, out)
                base = res if tp == 1 else base
                lines.append(row(res, shape, batch, tp, base if tp > 1 else None))
    table = "\n".join(lines)
    (out / "table.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
