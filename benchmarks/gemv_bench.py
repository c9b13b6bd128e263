"""The opt-in Triton split-K GEMV (`models/gemv_kernel.py`) against cuBLAS (F.linear) on the
Qwen3-8B projections, bf16, a few rows; each timed as a CUDA graph of 50 calls, with the
weight-read bandwidth it reaches. Outputs are checked against F.linear.

    python benchmarks/gemv_bench.py     (CUDA)
"""
import torch
import torch.nn.functional as F

from drafttree.bench.graph_timer import graphed_us
from drafttree.models import gemv_kernel

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}

print(f"{'proj':>8} {'M':>3} {'cuBLAS us':>10} {'TB/s':>6} " + " ".join(f"{'triton@' + str(t):>13} {'TB/s':>6}" for t in (264, 528, 1056)))
for name, (N, K) in SHAPES.items():
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    for M in (1, 4, 16):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x, w)
        row = [graphed_us(lambda: F.linear(x, w))]
        for t in (264, 528, 1056):
            gemv_kernel.TARGET_PROGRAMS = t
            torch.testing.assert_close(gemv_kernel.linear(x, w), ref, atol=2e-2, rtol=2e-2)
            row.append(graphed_us(lambda: gemv_kernel.linear(x, w)))
        tbs = [2 * N * K / (us * 1e-6) / 1e12 for us in row]
        print(f"{name:>8} {M:>3} " + " ".join(f"{us:10.2f} {bw:6.2f}" for us, bw in zip(row, tbs)), flush=True)
