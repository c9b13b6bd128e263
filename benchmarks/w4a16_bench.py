"""The W4A16 kernels on CUDA at Kimi K2's shapes: a dense int4 linear (`kernels/int4_kernel.py`;
7168 -> 18432 and back) and one rank's routed int4 experts (`kernels/int4_moe_kernel.py`; 48 of
384 experts, D 7168, I 2048, top-8, so most picks are another rank's), group size 32, bf16
activations, against (a) the torch forms they replace (`int4_ops`: the weight unpacked, then
matmuls) and (b) the 16-bit kernels on bf16 weights of the same shapes (F.linear; the grouped
GEMMs, `dispatch.moe_experts`). Each is timed as a CUDA graph of calls cycling over weight copies
together larger than L2, so that the weights come from HBM, as in a forward.

Per row: µs per call, the int4 floor (the bytes of the packed words and scales the call must read:
the whole weight, or the experts its routing hits, over --hbm-bytes-per-s) and each time's ratio
to it. One row (decode) also times the tiles in the GEMVs' place (dense and experts); the experts also time the blocks
this rank's pairs alone would choose, where those differ from the code's (sized by all N·k). A configuration that fails is
reported as its error and the rest still run. --sweep times candidate blocks per row and keeps
the fastest (each candidate compiles anew: sweep a few rows at a time, e.g. --only experts --rows
33 --sweep); --out writes every row as JSON.

    python benchmarks/w4a16_bench.py [--rows 1,8,33,528,2048] [--only dense,experts]
        [--hbm-bytes-per-s 4.8e12] [--sweep] [--out w4a16.json]                         (CUDA)
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from drafttree.bench.graph_timer import COLD_BYTES, graphed_us
from drafttree.kernels import int4_kernel, int4_moe_kernel, int4_ops, moe_kernel
from drafttree.settings import current

DT = torch.bfloat16
D, I, E_LOCAL, E_ROUTED, TOPK, GROUP = 7168, 2048, 48, 384, 8, 32
DENSE = {"up": (18432, D), "down": (D, 18432)}   # (N, K)


def packed_bytes(rows: int, K: int, G: int) -> int:
    """Bytes of an int4 weight [rows, K]: the words and the bf16 scales."""
    return rows * K // 2 + rows * (K // G) * 2


def copies_for(nbytes: int) -> int:
    """Enough copies that a graph cycling over them reads each from HBM (L2 holds none of the
    last few)."""
    return max(2, math.ceil(2 * COLD_BYTES / max(nbytes, 1)) + 1)


def int4_weights(shape: tuple[int, ...], K: int, G: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed words (uniform nibbles) and scales ~ 1 / (4 sqrt(K)), made on the GPU."""
    packed = torch.randint(-2 ** 31, 2 ** 31 - 1, (*shape, K // 8), device="cuda", dtype=torch.int32)
    scale = ((torch.rand(*shape, K // G, device="cuda") + 0.5) / (4 * K ** 0.5)).to(DT)
    return packed, scale


def cycled(fn: Callable[[Any], Any], items: list[Any]) -> float:
    """µs per call of fn(item) in a CUDA graph cycling over the items."""
    state = [0]

    def call() -> Any:
        state[0] = (state[0] + 1) % len(items)
        return fn(items[state[0]])
    n = max(8, len(items))
    return graphed_us(call, n=n, replays=max(3, 80 // n))


def attempt(row: dict, key: str, fn: Callable[[], float]) -> None:
    """row[key] = fn(), or the error (a configuration that fails does not stop the others)."""
    try:
        row[key] = fn()
    except Exception as e:   # noqa: BLE001  (reported per configuration)
        row[key] = None
        row.setdefault("errors", {})[key] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        traceback.print_exc()
    torch.cuda.empty_cache()


def ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",")]


# -- the dense linear -------------------------------------------------------------------------------


def dense_candidates(args: argparse.Namespace, M: int) -> list[int4_kernel.Blocks | int4_kernel.GemvBlocks]:
    if M == 1:
        gemv = [int4_kernel.GemvBlocks(*c) for c in itertools.product(ints(args.gemv_bn), ints(args.gemv_bkw),
                                                                     ints(args.warps), ints(args.stages))]
    else:
        gemv = []
    bm = min(128, max(16, 1 << (M - 1).bit_length()))
    tiles = [int4_kernel.Blocks(bm, *c) for c in itertools.product(ints(args.bn), ints(args.bkw), ints(args.warps),
                                                                   ints(args.stages))]
    return gemv + tiles


def bench_dense(name: str, N: int, K: int, rows: list[int], args: argparse.Namespace) -> list[dict]:
    size = packed_bytes(N, K, GROUP)
    weights = [int4_weights((N,), K, GROUP) for _ in range(copies_for(size))]
    dense = [torch.randn(N, K, device="cuda", dtype=DT) / K ** 0.5 for _ in range(copies_for(N * K * 2))]
    floor_us = size / args.hbm_bytes_per_s * 1e6
    print(f"\ndense {name}: {K} -> {N}, group {GROUP}, int4 {size / 1e6:.1f} MB ({len(weights)} copies), "
          f"floor {floor_us:.1f} µs at {args.hbm_bytes_per_s / 1e12:.2f} TB/s")
    print(f"{'rows':>5s} {'kernel':>9s} {'x floor':>7s} {'tiles@1':>9s} {'torch':>9s} {'bf16':>9s}  err       blocks")
    out = []
    for M in rows:
        x = torch.randn(M, K, device="cuda", dtype=DT)
        row: dict[str, Any] = {"kind": "dense", "shape": name, "N": N, "K": K, "rows": M, "group": GROUP,
                               "int4_bytes": size, "floor_us": floor_us}
        attempt(row, "kernel_us", lambda: cycled(lambda w: int4_kernel.linear(x, w[0], w[1], GROUP), weights))
        if M == 1:
            attempt(row, "tiles_us", lambda: cycled(
                lambda w: int4_kernel.linear(x, w[0], w[1], GROUP, blocks=int4_kernel.blocks_for(1)), weights))
        attempt(row, "torch_us", lambda: cycled(lambda w: int4_ops.linear(x, w[0], w[1], GROUP), weights))
        attempt(row, "bf16_us", lambda: cycled(lambda w: F.linear(x, w), dense))
        if args.sweep:
            best = None
            for b in dense_candidates(args, M):
                try:
                    us = cycled(lambda w, b=b: int4_kernel.linear(x, w[0], w[1], GROUP, blocks=b), weights)
                except Exception as e:   # noqa: BLE001  (a tile the GPU cannot hold)
                    print(f"    {tuple(b)}: {type(e).__name__}", flush=True)
                    continue
                if best is None or us < best[0]:
                    best = (us, b)
            if best is not None:
                row["sweep_us"], row["sweep_blocks"] = best[0], [type(best[1]).__name__, *best[1]]
        try:
            got = int4_kernel.linear(x, *weights[0], GROUP).float()
            want = int4_ops.linear(x, *weights[0], GROUP).float()
            row["err"] = float((got - want).abs().max() / want.abs().max())
        except Exception as e:   # noqa: BLE001
            row["err"] = None
            row.setdefault("errors", {})["err"] = f"{type(e).__name__}: {e}"
        row["blocks"] = list(int4_kernel.GEMV if M == 1 and int4_kernel.GEMV_ONE_ROW else int4_kernel.blocks_for(M))
        print_row(row, ["kernel_us", "tiles_us", "torch_us", "bf16_us"])
        out.append(row)
    del weights, dense
    torch.cuda.empty_cache()
    return out


# -- the routed experts -----------------------------------------------------------------------------


def routing(M: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-8 of 384 per token, uniform, as rank 0 of 8 sees it: ids past its 48 experts become E.
    The first seed from `seed` up whose routing picks at least one of this rank's experts (a
    decode picks none about a third of the time, and then times the launches alone)."""
    while True:
        g = torch.Generator().manual_seed(seed)
        routed = torch.stack([torch.randperm(E_ROUTED, generator=g)[:TOPK] for _ in range(M)])
        if (routed < E_LOCAL).any():
            break
        seed += 1
    w = torch.rand(M, TOPK, generator=g)
    idx = torch.where(routed < E_LOCAL, routed, E_LOCAL)
    return (w / w.sum(1, keepdim=True)).cuda(), idx.cuda()


def expert_candidates(args: argparse.Namespace, code: int4_moe_kernel.Blocks,
                      M: int) -> list[int4_moe_kernel.Blocks | int4_kernel.GemvBlocks]:
    """The sweep's blocks: one token, the GEMVs' too; slots per tile from --bm, else the code's
    and the next size up."""
    gemv = [int4_kernel.GemvBlocks(*c) for c in itertools.product(
        ints(args.gemv_bn), ints(args.gemv_bkw), ints(args.warps), ints(args.stages))] if M == 1 else []
    bm = ints(args.bm) if args.bm else sorted({code.bm, min(64, 2 * code.bm)})
    return gemv + [int4_moe_kernel.Blocks(*c) for c in itertools.product(
        bm, ints(args.bn_up), ints(args.bn_down), ints(args.bkw), ints(args.warps), ints(args.stages))]


def bench_experts(rows: list[int], args: argparse.Namespace) -> list[dict]:
    expert = packed_bytes(2 * I, D, GROUP) + packed_bytes(D, I, GROUP)
    # a decode hits about one of this rank's experts: enough layers that those pass L2 thrice over
    copies = max(3, min(8, math.ceil(3 * COLD_BYTES / expert)))
    layers = []
    for _ in range(copies):
        layers.append((*int4_weights((E_LOCAL, 2 * I), D, GROUP), *int4_weights((E_LOCAL, D), I, GROUP)))
    dense = [(torch.randn(E_LOCAL, 2 * I, D, device="cuda", dtype=DT) / D ** 0.5,
              torch.randn(E_LOCAL, D, I, device="cuda", dtype=DT) / I ** 0.5) for _ in range(2)]
    print(f"\nexperts: {E_LOCAL} of {E_ROUTED} on this rank, top-{TOPK}, D {D}, I {I}, group {GROUP}; int4 "
          f"{expert / 1e6:.1f} MB an expert ({copies} layer copies); floor: the experts hit, at "
          f"{args.hbm_bytes_per_s / 1e12:.2f} TB/s")
    print(f"{'rows':>5s} {'hit':>4s} {'floor':>7s} {'kernel':>9s} {'x floor':>7s} {'tiles@1':>9s} {'torch':>9s} {'torch all':>9s} "
          f"{'bf16':>9s}  err       blocks")
    out = []
    for M in rows:
        w, idx = routing(M, seed=M)
        x = torch.randn(M, D, device="cuda", dtype=DT)
        hit = int(torch.unique(idx[idx < E_LOCAL]).numel())
        floor_us = hit * expert / args.hbm_bytes_per_s * 1e6
        row: dict[str, Any] = {"kind": "experts", "rows": M, "pairs": M * TOPK,
                               "local_pairs": int((idx < E_LOCAL).sum()), "experts_hit": hit,
                               "int4_bytes": hit * expert, "floor_us": floor_us, "group": GROUP}

        def kernel(ly, b=None):
            return int4_moe_kernel.fused_experts(x, w, idx, *ly, GROUP, b, dropless=False)
        attempt(row, "kernel_us", lambda: cycled(kernel, layers))
        if M == 1:   # the tiles the GEMVs replace
            attempt(row, "tiles_us", lambda: cycled(lambda ly: kernel(ly, int4_moe_kernel.blocks_for(TOPK, E_LOCAL)),
                                                    layers))
        # The code sizes tiles by all N·k pairs (it cannot count this rank's without a read-back):
        # the tiles this rank's pairs alone would take, where they differ.
        local = int4_moe_kernel.blocks_for(max(1, row["local_pairs"]), E_LOCAL)
        if local != int4_moe_kernel.blocks_for(M * TOPK, E_LOCAL):
            row["local_blocks"] = list(local)
            attempt(row, "local_blocks_us", lambda: cycled(lambda ly: kernel(ly, local), layers))
        # each pair's expert unpacked: transients of about 12 bytes a weight, per pair
        if M * TOPK * 3 * I * D * 12 <= args.torch_max_gb * 1e9:
            attempt(row, "torch_us", lambda: cycled(lambda ly: int4_ops.experts(x, w, idx, *ly, GROUP), layers))
        attempt(row, "torch_all_us", lambda: cycled(lambda ly: int4_ops.experts_all(x, w, idx, *ly, GROUP), layers))
        attempt(row, "bf16_us", lambda: cycled(
            lambda ly: moe_kernel.fused_experts(x, w, idx, ly[0], ly[1], dropless=False), dense))
        if args.sweep:
            best = None
            for b in expert_candidates(args, int4_moe_kernel.blocks_for(M * TOPK, E_LOCAL), M):
                try:
                    us = cycled(lambda ly, b=b: kernel(ly, b), layers)
                except Exception as e:   # noqa: BLE001  (a tile the GPU cannot hold)
                    print(f"    {tuple(b)}: {type(e).__name__}", flush=True)
                    continue
                if best is None or us < best[0]:
                    best = (us, b)
            if best is not None:
                row["sweep_us"], row["sweep_blocks"] = best[0], [type(best[1]).__name__, *best[1]]
        try:
            got = kernel(layers[0]).float()
            want = int4_ops.experts_all(x, w, idx, *layers[0], GROUP).float()
            row["err"] = float((got - want).abs().max() / want.abs().max())
        except Exception as e:   # noqa: BLE001
            row["err"] = None
            row.setdefault("errors", {})["err"] = f"{type(e).__name__}: {e}"
        gemv = M == 1 and int4_moe_kernel.GEMV_ONE_TOKEN
        row["blocks"] = list(int4_moe_kernel.GEMV if gemv else int4_moe_kernel.blocks_for(M * TOPK, E_LOCAL))
        print_row(row, ["kernel_us", "tiles_us", "torch_us", "torch_all_us", "bf16_us"], hit=True)
        out.append(row)
    del layers, dense
    torch.cuda.empty_cache()
    return out


def print_row(row: dict, keys: list[str], hit: bool = False) -> None:
    def us(key: str) -> str:
        v = row.get(key)
        return f"{'-':>9s}" if v is None else f"{v:9.1f}"
    ratio = row["kernel_us"] / row["floor_us"] if row.get("kernel_us") and row["floor_us"] else None
    row["kernel_over_floor"] = ratio
    lead = f"{row['rows']:5d} " + (f"{row['experts_hit']:4d} {row['floor_us']:7.1f} " if hit else "")
    cells = [us(keys[0]), f"{ratio:7.2f}" if ratio else f"{'-':>7s}"] + [us(k) for k in keys[1:]]
    err = f"{row['err']:.1e}" if row.get("err") is not None else "-"
    sweep = f"  sweep {row['sweep_us']:.1f} µs {row['sweep_blocks']}" if "sweep_us" in row else ""
    if row.get("local_blocks_us"):
        sweep += f"  this rank's pairs' blocks {tuple(row['local_blocks'])}: {row['local_blocks_us']:.1f} µs"
    print(lead + " ".join(cells) + f"  {err:8s}  {tuple(row['blocks'])}{sweep}", flush=True)
    for key, e in row.get("errors", {}).items():
        print(f"      {key}: {e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,33,528,2048")
    ap.add_argument("--only", default="dense,experts")
    ap.add_argument("--hbm-bytes-per-s", type=float, default=4.8e12, help="the floor's read rate (H200: 4.8e12 peak)")
    ap.add_argument("--torch-max-gb", type=float, default=24.0,
                    help="skip the per-pair torch form where its unpacked experts would pass this")
    ap.add_argument("--sweep", action="store_true", help="time candidate blocks per row, keep the fastest")
    ap.add_argument("--bm", default="", help="sweep, experts: slots per tile (default: the code's and twice it)")
    ap.add_argument("--bn", default="64,128", help="sweep, dense tiles: weight rows per program")
    ap.add_argument("--bn-up", default="32,64", help="sweep, experts: gate (and up) rows per program")
    ap.add_argument("--bn-down", default="64,128", help="sweep, experts: down rows per program")
    ap.add_argument("--bkw", default="32,64", help="sweep: packed words per step")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="3,4")
    ap.add_argument("--gemv-bn", default="8,16,32", help="sweep, one row: weight rows per GEMV program")
    ap.add_argument("--gemv-bkw", default="64,128,256", help="sweep, one row: packed words per GEMV step")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("w4a16_bench times CUDA graphs: it needs a GPU")
    torch.set_grad_enabled(False)
    rows = ints(args.rows)
    only = args.only.split(",")
    results: list[dict] = []
    if "dense" in only:
        for name, (N, K) in DENSE.items():
            results += bench_dense(name, N, K, rows, args)
    if "experts" in only:
        results += bench_experts(rows, args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": __import__("triton").__version__, "settings": current().as_dict(),
                       "hbm_bytes_per_s": args.hbm_bytes_per_s, "rows": results}, f, indent=1)
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
