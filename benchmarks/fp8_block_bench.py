"""Block-scaled fp8 weights (DeepSeek-V3 / Kimi K2: e4m3 with a scale per 128 x 128 block) on
CUDA: the weight-only kernels (`kernels/fp8_block_kernel.py`, `kernels/fp8_block_moe.py`) against
the torch forms they replace (`kernels/fp8_block_ops.py`: widened to bf16, then matmul) and
against bf16 weights of the same shapes on the 16-bit paths: cuBLAS and the engine's projections
(`dispatch.gemv`: the one-token GEMV and few-row tiles where they run) for a linear layer, the
grouped GEMMs (`moe_kernel`) for routed experts. Each form is timed as a CUDA graph of calls
cycling over copies of its weights, together larger than L2, so that weights come from HBM as
in a forward.

Rows: a decode (1), a decode batch (8), a DDTree verify at budget 32 (33), a prefill chunk (528),
a prefill (2048). Linear shapes as inputs:outputs (default: the dense MLP's 7168:18432, kv_a's
7168:576, q_b's 1536:24576, the dense down 18432:7168, an input edge block 1600:2112). Experts:
D 7168, I 2048, top-8, --experts on this rank out of --global-experts (pairs routed to the others
are ids E: skipped, as on a sharded rank).

Per shape and row count: µs per call of each form; `floor`, the fp8 weight bytes (scales
included; for experts those of the experts the routing hits on this rank) over --bandwidth;
`ratio`, the kernel's time over that floor; `err`, the kernel's largest difference from the
exact product (fp32 sums of the dequantized weights) relative to its largest value. A failure
(out of memory, a compile error) is reported for its form, row or shape, and the rest go on.
--sweep times candidate blocks per row count and keeps the fastest; --out writes every row as JSON.

    python benchmarks/fp8_block_bench.py [--linear 7168:18432,...] [--rows 1,8,33,528,2048]
        [--experts 48] [--global-experts 48] [--bandwidth 4.8e12] [--sweep] [--out fp8.json]   (CUDA)
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # this checkout's package
from drafttree.bench.environment import environment  # noqa: E402
from drafttree.bench.graph_timer import COLD_BYTES, cycling, graphed_us  # noqa: E402
from drafttree.kernels import dispatch, fp8_block_kernel, fp8_block_moe, fp8_block_ops, moe_kernel  # noqa: E402
from drafttree.kernels.torch_ops import silu_mul  # noqa: E402

DT = torch.bfloat16
DEVICE = "cuda"
Q = (128, 128)
LINEAR = "7168:18432,7168:576,1536:24576,18432:7168,1600:2112"


def fp8_weight(N: int, K: int, lead: tuple[int, ...] = (), seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random [*lead, N, K] weights (~ 1/sqrt(K)) quantized in Q blocks, one matrix at a time."""
    device = DEVICE
    g = torch.Generator(device=device).manual_seed(seed)
    count = math.prod(lead)
    q = torch.empty(count, N, K, dtype=torch.float8_e4m3fn, device=device)
    s = torch.empty(count, -(-N // Q[0]), -(-K // Q[1]), dtype=torch.float32, device=device)
    for i in range(count):
        q[i], s[i] = fp8_block_ops.quantize(torch.randn(N, K, generator=g, device=device) / K ** 0.5, Q)
    return q.view(*lead, N, K), s.view(*lead, *s.shape[1:])


def copies_for(nbytes: int, least: int = 2) -> int:
    """Weight copies that together pass COLD_BYTES (so a graph cycling over them reads HBM)."""
    return max(least, -(-COLD_BYTES // nbytes))


def timed(make: Callable[[Any], Any], weights: list[Any]) -> float:
    """µs per call of make(weights[i]) in a CUDA graph cycling over the copies."""
    n = max(8, len(weights))
    return graphed_us(cycling(make, weights), n=n, replays=max(3, 80 // n))


def attempt(row: dict, key: str, fn: Callable[[], Any]) -> Any:
    """row[key] = fn(); a failure goes to row[key + '_error'] and the caller carries on."""
    try:
        row[key] = fn()
    except Exception as e:   # out of memory, a tile the GPU cannot hold, a compile error
        row[key] = None
        row[key + "_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        torch.cuda.empty_cache()
    return row[key]


def rel_err(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float((got.float() - exact).abs().max() / exact.abs().max())


def linear_candidates(args: argparse.Namespace, rows: int) -> list[fp8_block_kernel.Blocks]:
    ints = [[int(v) for v in s.split(",")] for s in (args.bn, args.bm, args.bk, args.warps, args.stages)]
    splits = [int(v) for v in args.split.split(",")]
    return [fp8_block_kernel.Blocks(bn, bm, bk, w, st, 8, sp)
            for bn, bm, bk, w, st in itertools.product(*ints) for sp in splits
            if bm <= max(16, 1 << (rows - 1).bit_length())]


def expert_candidates(args: argparse.Namespace) -> list[moe_kernel.Blocks]:
    ints = [[int(v) for v in s.split(",")] for s in (args.moe_bm, args.bn_up, args.bn_down, args.moe_bk,
                                                      args.warps, args.stages)]
    return [moe_kernel.Blocks(*c) for c in itertools.product(*ints)]


def fastest(time_of: Callable[[Any], float], code: Any, candidates: list[Any], sweep: bool) -> tuple[float, Any]:
    """The code's blocks (None) timed, and with `sweep` every candidate: the fastest (µs, blocks)."""
    best = (time_of(None), code)
    for b in candidates if sweep else []:
        try:
            us = time_of(b)
        except Exception as e:
            print(f"    {tuple(b)}: {type(e).__name__}", flush=True)
            torch.cuda.empty_cache()
            continue
        if us < best[0]:
            best = (us, b)
    return best


def bench_linear(K: int, N: int, rows: list[int], args: argparse.Namespace) -> list[dict]:
    q, s = fp8_weight(N, K, seed=N + K)
    fp8_bytes = q.numel() + 4 * s.numel()
    fp8 = [(q, s)] + [(q.clone(), s.clone()) for _ in range(copies_for(fp8_bytes) - 1)]
    w16 = fp8_block_ops.dequantize(q, s, Q, DT)
    bf16 = [w16] + [w16.clone() for _ in range(copies_for(w16.numel() * 2) - 1)]
    exact_w = fp8_block_ops.dequantize(q, s, Q)
    out = []
    print(f"\nlinear {K} -> {N}: fp8 {fp8_bytes / 1e6:.1f} MB, {len(fp8)} copies (bf16: {len(bf16)}); µs per call")
    print(f"{'rows':>5s} {'floor':>7s} {'fp8':>8s} {'ratio':>6s} {'torch':>8s} {'bf16':>8s} {'cublas':>8s} "
          f"{'err':>8s}  blocks")
    for M in rows:
        row: dict[str, Any] = {"in": K, "out": N, "rows": M, "fp8_bytes": fp8_bytes,
                               "floor_us": fp8_bytes / args.bandwidth * 1e6}
        try:
            x = torch.randn(M, K, device=DEVICE, dtype=DT)

            def kernel_us(b):
                return timed(lambda w: fp8_block_kernel.linear(x, w[0], w[1], Q, None, b), fp8)
            code = fp8_block_kernel.blocks_for(M)
            best = attempt(row, "fp8_us", lambda: fastest(kernel_us, code, linear_candidates(args, M), args.sweep))
            blocks = None if best is None else best[1]
            if best is not None:
                row["fp8_us"], row["blocks"] = best[0], list(blocks)
                row["ratio"] = best[0] / row["floor_us"]
                row["split"] = fp8_block_kernel.plan(M, N, K, Q, blocks).split
            attempt(row, "err", lambda: rel_err(fp8_block_kernel.linear(x, q, s, Q, None, blocks),
                                                x.float() @ exact_w.T))
            attempt(row, "torch_us", lambda: timed(lambda w: fp8_block_ops.linear(x, w[0], w[1], Q), fp8))
            attempt(row, "cublas_us", lambda: timed(lambda w: F.linear(x, w), bf16))
            # the engine's 16-bit path at this width: its projections where they run, else cuBLAS
            attempt(row, "bf16_us", lambda: timed(
                lambda w: dispatch.gemv(x, w) if dispatch.projection_kernels(x) else F.linear(x, w), bf16))
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            torch.cuda.empty_cache()
        out.append(row)
        print_row(row)
    return out


def by_expert(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, gu: torch.Tensor, gus: torch.Tensor,
              dn: torch.Tensor, dns: torch.Tensor) -> torch.Tensor:
    """The exact routed experts (fp32, dequantized weights), one GEMM per expert hit."""
    E = gu.shape[0]
    y = torch.zeros(x.shape[0], dn.shape[1], device=x.device)
    for e in idx.unique().tolist():
        if e == E:
            continue
        tok, j = (idx == e).nonzero(as_tuple=True)
        h = F.linear(x[tok].float(), fp8_block_ops.dequantize(gu[e], gus[e], Q))
        y.index_add_(0, tok, F.linear(silu_mul(h), fp8_block_ops.dequantize(dn[e], dns[e], Q)) * w[tok, j, None])
    return y


def routing(N: int, k: int, E: int, G: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k distinct experts of G per token, uniform; those past this rank's E become id E."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(G, generator=g)[:k] for _ in range(N)])
    w = torch.rand(N, k, generator=g)
    return (w / w.sum(dim=1, keepdim=True)).to(DEVICE), idx.clamp(max=E).to(DEVICE)


def bench_experts(rows: list[int], args: argparse.Namespace) -> list[dict]:
    D, I, E, G, k = args.hidden, args.intermediate, args.experts, args.global_experts, args.top_k
    gu, gus = fp8_weight(2 * I, D, (E,), seed=1)
    dn, dns = fp8_weight(D, I, (E,), seed=2)
    expert_bytes = 3 * I * D + 4 * (gus[0].numel() + dns[0].numel())
    copies = max(2, min(4, math.ceil(4 * COLD_BYTES / (min(k, E) * expert_bytes))))
    fp8 = [(gu, gus, dn, dns)] + [tuple(t.clone() for t in (gu, gus, dn, dns)) for _ in range(copies - 1)]
    gu16 = fp8_block_ops.dequantize(gu, gus, Q, DT)
    dn16 = fp8_block_ops.dequantize(dn, dns, Q, DT)
    bf16 = [(gu16, dn16)] + [(gu16.clone(), dn16.clone()) for _ in range(copies - 1)]
    dropless = G == E
    out = []
    print(f"\nexperts D={D} I={I} top-{k}, {E} of {G} on this rank: fp8 {expert_bytes / 1e6:.1f} MB an expert, "
          f"{copies} copies; µs per call")
    print(f"{'rows':>5s} {'hit':>4s} {'floor':>7s} {'fp8':>8s} {'ratio':>6s} {'torch':>8s} {'bf16':>8s} "
          f"{'err':>8s}  blocks")
    for N in rows:
        row: dict[str, Any] = {"rows": N, "experts": E, "global_experts": G, "top_k": k}
        try:
            w, idx = routing(N, k, E, G, seed=N)
            x = torch.randn(N, D, device=DEVICE, dtype=DT)
            hit = int((torch.unique(idx) < E).sum())
            row.update(experts_hit=hit, fp8_bytes=hit * expert_bytes,
                       floor_us=hit * expert_bytes / args.bandwidth * 1e6)

            def kernel_us(b):
                return timed(lambda ws: fp8_block_moe.fused_experts(x, w, idx, *ws, Q, b, dropless=dropless), fp8)
            code = fp8_block_moe.blocks_for(N * k, E)
            best = attempt(row, "fp8_us", lambda: fastest(kernel_us, code, expert_candidates(args), args.sweep))
            blocks = None if best is None else best[1]
            if best is not None:
                row["fp8_us"], row["blocks"] = best[0], list(blocks)
                row["ratio"] = best[0] / row["floor_us"] if hit else None
            attempt(row, "err", lambda: rel_err(
                fp8_block_moe.fused_experts(x, w, idx, gu, gus, dn, dns, Q, blocks, dropless=dropless),
                by_expert(x, w, idx, gu, gus, dn, dns)))
            # the torch form widens one expert per pair, in fp32 on the way (about 14 bytes an element)
            transient_gb = N * k * 3 * I * D * 14 / 1e9
            if transient_gb <= args.torch_max_gb:
                attempt(row, "torch_us", lambda: timed(lambda ws: fp8_block_ops.experts(x, w, idx, *ws, Q), fp8))
            else:
                row["torch_us"], row["torch_us_error"] = None, f"skipped: a {transient_gb:.0f} GB transient"
            attempt(row, "bf16_us", lambda: timed(
                lambda ws: moe_kernel.fused_experts(x, w, idx, ws[0], ws[1], dropless=dropless), bf16))
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            torch.cuda.empty_cache()
        out.append(row)
        print_row(row)
    return out


def print_row(row: dict) -> None:
    def us(key: str) -> str:
        v = row.get(key)
        return f"{v:8.1f}" if isinstance(v, float) else f"{'-':>8s}"
    ratio = f"{row['ratio']:6.2f}" if isinstance(row.get("ratio"), float) else f"{'-':>6s}"
    err = f"{row['err']:8.1e}" if isinstance(row.get("err"), float) else f"{'-':>8s}"
    hit = f"{row['experts_hit']:4d} " if "experts_hit" in row else ""
    cols = (f"{us('torch_us')} {us('bf16_us')} {us('cublas_us')}" if "cublas_us" in row
            else f"{us('torch_us')} {us('bf16_us')}")
    print(f"{row['rows']:5d} {hit}{us('floor_us')[1:]} {us('fp8_us')} {ratio} {cols} {err}  "
          f"{tuple(row['blocks']) if row.get('blocks') else ''}", flush=True)
    for key in sorted(k for k in row if k.endswith("error")):
        print(f"      {key}: {row[key]}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--linear", default=LINEAR, help="inputs:outputs per linear shape ('' for none)")
    ap.add_argument("--rows", default="1,8,33,528,2048")
    ap.add_argument("--experts", type=int, default=48, help="experts on this rank (0: no expert rows)")
    ap.add_argument("--global-experts", type=int, default=None, help="experts routed among (default: --experts)")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--bandwidth", type=float, default=4.8e12, help="bytes per second of the weight-read floor")
    ap.add_argument("--torch-max-gb", type=float, default=40.0, help="skip the experts' torch form past this transient")
    ap.add_argument("--sweep", action="store_true", help="sweep the kernels' blocks per row count")
    ap.add_argument("--bn", default="64,128")
    ap.add_argument("--bm", default="16,32,64,128")
    ap.add_argument("--bk", default="64,128")
    ap.add_argument("--split", default="0,1")
    ap.add_argument("--moe-bm", default="16,32,64,128")
    ap.add_argument("--bn-up", default="32,64")
    ap.add_argument("--bn-down", default="64,128")
    ap.add_argument("--moe-bk", default="64,128")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="3,4")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.global_experts is None:
        args.global_experts = args.experts
    if not torch.cuda.is_available():
        raise SystemExit("fp8_block_bench times CUDA graphs: it needs a CUDA device")
    if not dispatch.fp8_runs_on("cuda"):
        raise SystemExit(f"e4m3 conversion needs compute capability 8.9 or newer; this GPU has "
                         f"{torch.cuda.get_device_capability()}")
    if args.global_experts < args.experts:
        raise SystemExit(f"--global-experts ({args.global_experts}) must be at least --experts ({args.experts})")
    rows = [int(r) for r in args.rows.split(",")]
    torch.set_grad_enabled(False)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "environment": environment(),
                              "bandwidth": args.bandwidth, "block": list(Q), "linear": [], "experts": [],
                              "failures": []}
    for shape in filter(None, args.linear.split(",")):
        try:
            K, N = (int(v) for v in shape.split(":"))
            report["linear"] += bench_linear(K, N, rows, args)
        except Exception as e:
            traceback.print_exc()
            report["failures"].append({"linear": shape, "error": f"{type(e).__name__}: {e}"})
        torch.cuda.empty_cache()
    if args.experts > 0:
        try:
            report["experts"] = bench_experts(rows, args)
        except Exception as e:
            traceback.print_exc()
            report["failures"].append({"experts": args.experts, "error": f"{type(e).__name__}: {e}"})
    for f in report["failures"]:
        print(f"failed: {f}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
