"""The one-token fused projections (`models/gemv_kernel.py`) against the torch ops they replace,
on Qwen3-8B's layer shapes, bf16, batch 1; each timed as a CUDA graph of 48 calls cycling over 8
weight copies (so the weights come from HBM, not L2). Sweeps the kernels' BLOCK_N and BLOCK_K.

    python benchmarks/gemv_bench.py [--block-n 8,16,32] [--block-k 128,256,512]     (CUDA)
"""
import argparse

import torch
import torch.nn.functional as F

from drafttree.bench.graph_timer import graphed_us
from drafttree.models import gemv_kernel
from drafttree.models.layers import add_rms_norm, silu_mul

ap = argparse.ArgumentParser()
ap.add_argument("--block-n", default="8,16,32")
ap.add_argument("--block-k", default="128,256,512")
args = ap.parse_args()

dev, dt, D, I = "cuda", torch.bfloat16, 4096, 12288
COPIES = 8
x, delta = (torch.randn(1, 1, D, device=dev, dtype=dt) for _ in range(2))
g = torch.ones(D, device=dev, dtype=dt)
gu = torch.randn(1, 1, 2 * I, device=dev, dtype=dt)
shapes = {"qkv (norm prologue)": (6144, D), "gate_up (norm prologue)": (2 * I, D), "down (silu prologue)": (D, I)}


def cycling(make):
    """A call that takes the next of COPIES weights each time (captured 48 times: 6 rounds)."""
    state = [0]

    def call():
        state[0] = (state[0] + 1) % COPIES
        return make(state[0])
    return call


for name, (N, K) in shapes.items():
    ws = [torch.randn(N, K, device=dev, dtype=dt) / K ** 0.5 for _ in range(COPIES)]
    gb = N * K * 2 / 1e9
    silu = name.startswith("down")
    if silu:
        torch_op = cycling(lambda i: F.linear(silu_mul(gu), ws[i]))
        ours = cycling(lambda i: gemv_kernel.silu_gemv(gu, ws[i]))
    else:
        torch_op = cycling(lambda i: F.linear(add_rms_norm(x, delta, g, 1e-6)[1], ws[i]))
        ours = cycling(lambda i: gemv_kernel.norm_gemv(x, delta, g, 1e-6, ws[i])[1])
    t = graphed_us(torch_op, n=48)
    print(f"{name}: N {N}, K {K}, {gb * 1e3:.1f} MB")
    print(f"  torch ops (prologue + cuBLAS):       {t:7.1f} us  {gb / t * 1e6:6.0f} GB/s")
    for bn in (int(v) for v in args.block_n.split(",")):
        for bk in (int(v) for v in args.block_k.split(",")):
            gemv_kernel.BLOCK_N, gemv_kernel.BLOCK_K = bn, bk
            t = graphed_us(ours, n=48)
            print(f"  fused, BLOCK_N {bn:3d}, BLOCK_K {bk:4d}:    {t:7.1f} us  {gb / t * 1e6:6.0f} GB/s", flush=True)
