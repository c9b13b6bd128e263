"""The fused projections (`kernels/gemv_kernel.py`, and for `--rows` above 1 `kernels/gemm_kernel.py`)
against the torch ops they replace, on one model's layer shapes (`drafttree.models.random_shapes`), bf16;
each timed as a CUDA graph of calls cycling over weight copies, at least 48 calls and one per
copy, the copies together larger than L2 (so the weights come from HBM, as in a forward). Sweeps
each kernel's block shape per matrix (one row: rows per program, columns per step, warps, steps
loaded before the PDL wait; more rows: also pipeline stages, input splits and token rows per
program) and writes the fastest per matrix, as [kernel, weight elements, blocks, us, torch ops'
us] rows (more rows' blocks end with the rows swept, the most they then cover, and the steps
before the wait). The engine takes
that file as `DRAFTTREE_BLOCKS=best.json` (`kernels/kernel_blocks.py`).

    python benchmarks/gemv_bench.py [--shape qwen3-8b] [-tp N] [--block-n 4,8,16] [--block-k 256,512,1024]
                                    [--warps 4,8] [--prefetch 1,2] [--out best.json]       (CUDA)
    python benchmarks/gemv_bench.py --rows 33 --block-n 32,64,128 --block-k 64,128 --warps 4 \
                                    [--stages 3,4] [--splits 1,2,4] [--row-block 16,64] [--prefetch 0,2] \
                                    [--prenormed] [--only qkv,gate_up]                     (CUDA)

`--prenormed` times the QKV and gate/up tiles without their norm prologue, after the torch ops'
add + RMSNorm launch: the alternative to the prologue where it loses to cuBLAS. `--fp8` times the
tiles on e4m3 weights with a scale per row (`models/quant.py`, the drafter's option) against the
bf16 torch ops (`--fp8-dot widen`: the e4m3 weights widened to bf16 for the dots instead of the
code's f16 dots); `--only ...,lm_head,fc` adds the LM head (the drafter's copy of it) and the drafter's fc.
"""
import argparse
import itertools
import json

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

from drafttree.bench.graph_timer import cycling, graphed_us, weight_copies
from drafttree.models.random_shapes import SHAPES, projections
from drafttree.kernels import dispatch, gemm_kernel, gemv_kernel, torch_ops
from drafttree.kernels.torch_ops import add_rms_norm
from drafttree.models import quant

ap = argparse.ArgumentParser()
ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                help="time one rank's shards of the layer (and of the LM head's rows)")
ap.add_argument("--block-n", default="4,8,16")
ap.add_argument("--block-k", default="256,512,1024")
ap.add_argument("--warps", default="4,8")
ap.add_argument("--prefetch", default="1", help="input steps loaded before the PDL wait (0: none, more rows only)")
ap.add_argument("--rows", type=int, default=1, help=f"token rows, 1 to {gemm_kernel.MAX_ROWS}")
ap.add_argument("--stages", default="3", help="pipeline stages (more than one row)")
ap.add_argument("--splits", default="1,2,4", help="input splits (more than one row)")
ap.add_argument("--row-block", default="64", help="token rows per program (more than one row)")
ap.add_argument("--prenormed", action="store_true",
                help="more than one row: the norm as its own launch, the QKV and gate/up tiles without it")
ap.add_argument("--only", default="qkv,o,gate_up,down", help="the matrices to time (also: lm_head, fc)")
ap.add_argument("--fp8", action="store_true", help="the tiles on e4m3 weights (BLOCKS_FP8), any rows")
ap.add_argument("--fp8-dot", default=gemm_kernel.FP8_DOT, choices=sorted(gemm_kernel.FP8_DOTS),
                help="with --fp8: f16 dots (the code's), or e4m3 widened to the inputs' dtype")
ap.add_argument("--out", default="")
args = ap.parse_args()
tiles = args.rows > 1 or args.fp8   # gemm_kernel's blocks (8 fields), not the GEMVs' (4)

cfg = SHAPES[args.shape][0]
dev, dt = "cuda", torch.bfloat16
x, delta = (torch.randn(1, args.rows, cfg.hidden_size, device=dev, dtype=dt) for _ in range(2))
g = torch.ones(cfg.hidden_size, device=dev, dtype=dt)
KIND = {"qkv": "norm", "o": "plain", "gate_up": "glu", "down": "plain", "lm_head": "plain", "fc": "plain"}


def calls(kind, ws):
    """(the torch ops, the fused kernel) for one shape, each cycling over the weight copies (with
    --fp8, the fused kernel over e4m3 copies of them and their scales)."""
    qs = [quant.quantize_rows(w) for w in ws] if args.fp8 else [(w, None) for w in ws]
    if kind == "plain":
        h = torch.randn(1, args.rows, ws[0].shape[1], device=dev, dtype=dt)
        return cycling(lambda w: F.linear(h, w), ws), cycling(lambda q: dispatch.gemv(h, q[0], None, q[1]), qs)
    unfused = cycling(lambda w: torch_ops.projection(kind, x, delta, g, 1e-6, w, None)[1], ws)
    if args.prenormed and args.rows > 1:   # the tiles' prologue off: NORM and HAS_D follow g and delta
        return unfused, cycling(lambda q: gemm_kernel.launch(kind, add_rms_norm(x, delta, g, 1e-6)[1], None, None,
                                                             0.0, q[0], None, q[1])[1], qs)
    fused = dispatch.norm_glu_gemv if kind == "glu" else dispatch.norm_gemv
    return unfused, cycling(lambda q: fused(x, delta, g, 1e-6, q[0], scale=q[1])[1], qs)

sweep = (args.block_n, args.block_k, args.warps) + ((args.stages, args.splits, args.row_block, args.prefetch)
                                                   if tiles else (args.prefetch,))
grid = list(itertools.product(*([int(v) for v in a.split(",")] for a in sweep)))
table = gemm_kernel.BLOCKS_FP8 if args.fp8 else gemv_kernel.BLOCKS if args.rows == 1 else gemm_kernel.BLOCKS


def with_covers(blocks: tuple) -> tuple:
    """More rows: the most token rows the blocks then cover go before the steps before the wait."""
    return blocks[:6] + (args.rows,) + blocks[6:] if tiles else blocks


best: list[tuple[str, int, tuple]] = []
fused_total = torch_total = 0.0
if args.fp8:   # which way the tiles multiply with 16-bit inputs
    gemm_kernel.FP8_DOT = args.fp8_dot
    print(f"{args.shape}, {args.rows} rows, fp8 tiles with {gemm_kernel.FP8_DOT} dots")
drafter_fc = (cfg.hidden_size, len(SHAPES[args.shape][1]["target_layer_ids"]) * cfg.hidden_size)
head_rows = -(-cfg.vocab_size // args.tensor_parallel_size)   # a vocabulary-parallel head's shard
for name, (N, K) in {**projections(cfg, args.tensor_parallel_size), "lm_head": (head_rows, cfg.hidden_size),
                     "fc": drafter_fc}.items():
    if name not in args.only.split(","):
        continue
    # fp8 copies are half the bytes: twice as many stay clear of L2 (the LM head is larger than L2)
    copies = 2 if name == "lm_head" else max(8, -(-(256 << 20) // (N * K * 2))) if args.fp8 else None
    kind, ws = KIND[name], weight_copies(N, K, copies)
    calls_per_graph = max(48, len(ws))
    gb = N * K * (1 if args.fp8 else 2) / 1e9
    torch_op, ours = calls(kind, ws)
    t = t_torch = graphed_us(torch_op, n=calls_per_graph)
    torch_total += t
    print(f"{name} ({kind}): N {N}, K {K}, {gb * 1e3:.1f} MB")
    print(f"  torch ops (prologue + cuBLAS):                   {t:7.1f} us  {N * K * 2 / t / 1e3:6.0f} GB/s")   # bf16
    times = {}
    for blocks in grid:
        table[kind] = [(0, with_covers(blocks))]
        try:
            times[blocks] = t = graphed_us(ours, n=calls_per_graph)
        except OutOfResources as e:   # a tile and its pipeline stages past shared memory
            print(f"  fused, {blocks}: {e}")
            continue
        more = (f", stages {blocks[3]}, splits {blocks[4]}, rows {blocks[5]}, before the wait {blocks[6]}"
                if tiles else f", before the wait {blocks[3]}")
        print(f"  fused, BLOCK_N {blocks[0]:3d}, BLOCK_K {blocks[1]:4d}, warps {blocks[2]}{more}: "
              f"{t:7.1f} us  {gb / t * 1e6:6.0f} GB/s", flush=True)
    fastest = min(times, key=times.get)
    fused_total += times[fastest]
    best.append((kind, N * K, with_covers(fastest), times[fastest], t_torch))
    print(f"  fastest: {fastest}, {times[fastest]:.1f} us", flush=True)
    del ws

print(f"{args.rows} rows, one layer, us: torch ops {torch_total:.1f}, fused at each matrix's fastest blocks {fused_total:.1f}")
if args.out:
    with open(args.out, "w") as f:
        json.dump([[kind, numel, list(blocks), us, torch_us] for kind, numel, blocks, us, torch_us in best], f)
