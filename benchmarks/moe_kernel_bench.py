"""One MoE layer's routed experts, bf16, on CUDA: the grouped GEMMs (`Experts.grouped`, what
16-bit models run) against the torch forms they replace, `gathered` (weights copied per pair) and
`all_experts` (every expert over every row), each timed as a CUDA graph of calls cycling over
copies of the layer's experts (their hit weights together larger than L2, so read from HBM, as in
a forward); `sorted` (eager, reads its counts back) for reference. Rows: a decode (1), a decode
batch or DFlash verify (16), a DDTree verify at budget 32 (33), a prefill chunk (528). Routing:
k distinct experts per token, uniform, fixed seed.

Per form: µs per layer, and GB/s of the experts the routing hits (their bytes, each read once,
over the time: the floor every form has to read, so the columns compare). `floor` is those bytes
at --hbm-gbps. `err` is the kernels' largest difference from `all_experts`, relative to its
largest value. With --sweep the kernels' tiles (`moe_kernel.Blocks`) are swept per row and the
fastest kept; --out writes every row as JSON.

    python benchmarks/moe_kernel_bench.py [--shapes qwen3-30b-a3b,kimi-k2] [--rows 1,16,33,528]
        [--sweep] [--out moe.json]                                                      (CUDA)
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import time

import torch
from torch import nn

from drafttree.bench.graph_timer import COLD_BYTES, graphed_us
from drafttree.kernels import moe_kernel
from drafttree.models import moe
from drafttree.models.random_shapes import SHAPES
from drafttree.settings import current

DT = torch.bfloat16
DEVICE = "cuda"


def make_experts(D: int, cfg, copies: int) -> list[moe.Experts]:
    """`copies` layers of random experts, made on the GPU in bf16 (Kimi K2's are 34 GB a layer)."""
    E, I = cfg.num_experts, cfg.intermediate_size
    layers = []
    for _ in range(copies):
        with torch.device("meta"):
            ex = moe.Experts(D, cfg)
        ex.gate_up = nn.Parameter(torch.empty(E, 2 * I, D, device=DEVICE, dtype=DT).normal_(0, D ** -0.5),
                                  requires_grad=False)
        ex.down = nn.Parameter(torch.empty(E, D, I, device=DEVICE, dtype=DT).normal_(0, I ** -0.5),
                               requires_grad=False)
        layers.append(ex)
    return layers


def routing(N: int, k: int, E: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    w = torch.rand(N, k, generator=g)
    return (w / w.sum(dim=1, keepdim=True)).to(DEVICE), idx.to(DEVICE)


def timed(form, layers: list[moe.Experts], x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> float:
    """µs per call of form(experts, x, w, idx) in a CUDA graph cycling over the layers."""
    state = [0]

    def call() -> torch.Tensor:
        state[0] = (state[0] + 1) % len(layers)
        return form(layers[state[0]], x, w, idx)
    n = max(4, len(layers))
    return graphed_us(call, n=n, replays=max(3, 40 // n))


def eager_us(form, ex: moe.Experts, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, reps: int = 5) -> float:
    form(ex, x, w, idx)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        form(ex, x, w, idx)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / reps


def candidates(args: argparse.Namespace) -> list[moe_kernel.Blocks]:
    ints = [[int(v) for v in s.split(",")] for s in (args.bm, args.bn_up, args.bn_down, args.bk, args.warps,
                                                      args.stages)]
    return [moe_kernel.Blocks(*c) for c in itertools.product(*ints)]


def kernel_us(layers, x, w, idx, args) -> tuple[float, moe_kernel.Blocks]:
    """The kernels at the code's blocks, or with --sweep the fastest candidate."""
    code = moe_kernel.blocks_for(idx.numel(), layers[0].gate_up.shape[0])
    best = (timed(lambda ex, x, w, i: ex.grouped(x, w, i), layers, x, w, idx), code)
    if not args.sweep:
        return best
    for b in candidates(args):
        try:
            us = timed(lambda ex, x, w, i, b=b: moe_kernel.fused_experts(x, w, i, ex.gate_up, ex.down, b),
                       layers, x, w, idx)
        except Exception as e:   # a tile the GPU cannot hold (shared memory, registers)
            print(f"    {b}: {type(e).__name__}", flush=True)
            continue
        best = min(best, (us, b), key=lambda t: t[0])
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen3-30b-a3b,kimi-k2")
    ap.add_argument("--rows", default="1,16,33,528")
    ap.add_argument("--hbm-gbps", type=float, default=4260.0, help="the floor's read rate (H200: 4.26 TB/s measured)")
    ap.add_argument("--gather-max-gb", type=float, default=24.0,
                    help="skip `gathered` where its copies of the pairs' weights pass this")
    ap.add_argument("--sweep", action="store_true", help="sweep the kernels' blocks per row")
    ap.add_argument("--bm", default="16,32,64")
    ap.add_argument("--bn-up", default="32,64")
    ap.add_argument("--bn-down", default="64,128")
    ap.add_argument("--bk", default="64,128")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="3,4")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    assert torch.cuda.is_available(), "this benchmark times CUDA graphs"
    assert current().moe_kernel, "DRAFTTREE_MOE_KERNEL=0 would time the torch forms as the kernels"
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    torch.set_grad_enabled(False)
    for shape in args.shapes.split(","):
        cfg = SHAPES[shape][0]
        m, D = cfg.moe, cfg.hidden_size
        E, k, I = m.num_experts, m.top_k, m.intermediate_size
        expert_bytes = 3 * I * D * 2
        # enough layers that the fewest experts a call hits (k, one row) pass L2 several times over
        copies = max(1, min(4, math.ceil(4 * COLD_BYTES / (k * expert_bytes))))
        layers = make_experts(D, m, copies)
        print(f"\n{shape}: E={E} k={k} D={D} I={I}, bf16, {copies} layer cop{'y' if copies == 1 else 'ies'}, "
              f"µs per layer (GB/s of the experts hit)")
        print(f"{'rows':>5s} {'hit':>4s} {'floor':>8s} {'kernels':>16s} {'gathered':>16s} {'all_experts':>16s} "
              f"{'sorted':>9s} {'err':>8s}  blocks")
        for N in rows:
            w, idx = routing(N, k, E, seed=N)
            x = torch.randn(N, D, device=DEVICE, dtype=DT)
            hit = int(torch.unique(idx).numel())
            gb = hit * expert_bytes / 1e9
            row = {"shape": shape, "rows": N, "pairs": N * k, "experts_hit": hit, "hit_gb": gb,
                   "floor_us": gb / args.hbm_gbps * 1e6}
            row["kernels_us"], blocks = kernel_us(layers, x, w, idx, args)
            row["blocks"] = list(blocks)
            ref = layers[0].all_experts(x, w, idx).float()
            got = moe_kernel.fused_experts(x, w, idx, layers[0].gate_up, layers[0].down, blocks).float()
            row["err"] = float((got - ref).abs().max() / ref.abs().max())
            gather_gb = N * k * expert_bytes / 1e9
            row["gathered_us"] = (timed(lambda ex, x, w, i: ex.gathered(x, w, i), layers, x, w, idx)
                                  if gather_gb <= args.gather_max_gb else None)
            row["all_experts_us"] = timed(lambda ex, x, w, i: ex.all_experts(x, w, i), layers, x, w, idx)
            row["sorted_eager_us"] = eager_us(lambda ex, x, w, i: ex.sorted(x, w, i), layers[0], x, w, idx)
            results.append(row)

            def cell(us: float | None) -> str:
                return f"{'-':>16s}" if us is None else f"{us:8.1f} ({gb / us * 1e6:5.0f})"
            print(f"{N:5d} {hit:4d} {row['floor_us']:8.1f} {cell(row['kernels_us'])} {cell(row['gathered_us'])} "
                  f"{cell(row['all_experts_us'])} {row['sorted_eager_us']:9.1f} {row['err']:8.1e}  {tuple(blocks)}",
                  flush=True)
        del layers
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "hbm_gbps": args.hbm_gbps, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
