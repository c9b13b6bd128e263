"""cuBLAS projections at the row counts rounds use (decode 1, DFlash verify 16, DDTree verify 33,
and padded 48/64), on one model's layer shapes, bf16; each timed as a CUDA graph of 48 calls
cycling over 8 weight copies (weights from HBM). Shows where a verify's GEMMs fall short of the
weight-read rate and whether padding the rows would help.

    python benchmarks/verify_gemm_bench.py [--shape qwen3-8b] [--rows 1,16,33,48,64]      (CUDA)
"""
import argparse

import torch
import torch.nn.functional as F

from drafttree.bench.graph_timer import cycling, graphed_us, weight_copies
from drafttree.models.random_shapes import SHAPES, projections

ap = argparse.ArgumentParser()
ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
ap.add_argument("--rows", default="1,16,33,48,64")
args = ap.parse_args()
rows = [int(r) for r in args.rows.split(",")]
print(f"{args.shape}, bf16, us per call (GB/s of weights)")
print(f"{'matrix':8s}" + "".join(f"{f'{m} rows':>18s}" for m in rows))
total = dict.fromkeys(rows, 0.0)
for name, (N, K) in projections(SHAPES[args.shape][0]).items():
    ws = weight_copies(N, K)
    gb = N * K * 2 / 1e9
    line = f"{name:8s}"
    for m in rows:
        x = torch.randn(1, m, K, device="cuda", dtype=torch.bfloat16)
        t = graphed_us(cycling(lambda w, x=x: F.linear(x, w), ws), n=48)
        total[m] += t
        line += f"{t:10.1f} ({gb / t * 1e6:5.0f})"
    print(line, flush=True)
    del ws
print(f"{'layer':8s}" + "".join(f"{total[m]:10.1f}{'':8s}" for m in rows))
