"""cuBLAS projections at the row counts rounds use (decode 1, DFlash verify 16, DDTree verify 33,
and padded 48/64), on one model's layer shapes, bf16; each timed as a CUDA graph of 48 calls
cycling over 8 weight copies (weights from HBM). Shows where a verify's GEMMs fall short of the
weight-read rate and whether padding the rows would help.

    python benchmarks/verify_gemm_bench.py [--shape qwen3-8b] [--rows 1,16,33,48,64]      (CUDA)
"""
import argparse

import torch
import torch.nn.functional as F

from drafttree.bench.graph_timer import graphed_us
from drafttree.bench.shapes import SHAPES

ap = argparse.ArgumentParser()
ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
ap.add_argument("--rows", default="1,16,33,48,64")
args = ap.parse_args()
cfg = SHAPES[args.shape][0]
dev, dt, COPIES = "cuda", torch.bfloat16, 8
D, I, HD = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim
shapes = {"qkv": (HD + 2 * cfg.num_kv_heads * cfg.head_dim, D), "o": (D, HD), "gate_up": (2 * I, D), "down": (D, I)}
rows = [int(r) for r in args.rows.split(",")]
print(f"{args.shape}, bf16, us per call (GB/s of weights)")
print(f"{'matrix':8s}" + "".join(f"{f'{m} rows':>18s}" for m in rows))
total = dict.fromkeys(rows, 0.0)
for name, (N, K) in shapes.items():
    ws = [torch.randn(N, K, device=dev, dtype=dt) / K ** 0.5 for _ in range(COPIES)]
    gb = N * K * 2 / 1e9
    line = f"{name:8s}"
    for m in rows:
        x = torch.randn(1, m, K, device=dev, dtype=dt)
        state = [0]

        def call():
            state[0] = (state[0] + 1) % COPIES
            return F.linear(x, ws[state[0]])
        t = graphed_us(call, n=48)
        total[m] += t
        line += f"{t:10.1f} ({gb / t * 1e6:5.0f})"
    print(line, flush=True)
    del ws
print(f"{'layer':8s}" + "".join(f"{total[m]:10.1f}{'':8s}" for m in rows))
