"""The vocabulary top-K kernel (`kernels/topk_kernel.py`) at several chunk sizes, with and without the
group-maxima filter, on DDTree's draft logits [R, 15, 151,936] bf16; each timed as a CUDA graph
of 20 calls. Outputs must agree.

    python benchmarks/topk_chunk_bench.py [RxK ...] [--chunks 4096,8192] [--warps 4,8,16]    (CUDA)
"""
import argparse

import torch

from drafttree.bench.graph_timer import graphed_us
from drafttree.kernels import topk_kernel
from drafttree.kernels.topk_kernel import top_log_probs_fused
from drafttree.kernels.torch_ops import chunked_topk

ap = argparse.ArgumentParser()
ap.add_argument("cases", nargs="*", default=["1x8", "1x32", "16x8", "1x128"], help="rows x k")
ap.add_argument("--chunks", default="1024,2048,4096,8192")
ap.add_argument("--warps", default=str(topk_kernel.CHUNK_WARPS), help="num_warps of the chunk kernel, e.g. 4,8,16")
args = ap.parse_args()
CHUNKS = tuple((int(c), int(w)) for c in args.chunks.split(",") for w in args.warps.split(","))
CASES = [tuple(int(n) for n in c.split("x")) for c in args.cases]

print(f"{'filter':>6} {'R':>3} {'k':>4} {'torch topk':>11} " + " ".join(f"{f'{c}/{w}w':>11}" for c, w in CHUNKS) + "  (us per call)")
for filtered, R, k in [(f, R, k) for R, k in CASES for f in (True, False)]:
    x = torch.randn(R, 15, 151936, device="cuda").to(torch.bfloat16)
    topk_kernel.FILTERED = False    # the reference: whole chunks sorted
    ref = top_log_probs_fused(x, k)
    topk_kernel.FILTERED = filtered
    row = [graphed_us(lambda: chunked_topk(x.float(), k), 20)]
    for c, w in CHUNKS:
        try:   # small chunks give the merge program many candidates: it may not compile
            lp, idx = top_log_probs_fused(x, k, chunk=c, warps=w)
            assert torch.equal(idx, ref[1]) and torch.allclose(lp, ref[0], atol=1e-5), c
            row.append(graphed_us(lambda c=c, w=w: top_log_probs_fused(x, k, chunk=c, warps=w), 20))
        except Exception as e:  # noqa: BLE001
            print(f"R={R} k={k} chunk={c} warps={w}: {type(e).__name__}")
            row.append(float("nan"))
    print(f"{filtered!s:>6} {R:>3} {k:>4} " + " ".join(f"{t:11.1f}" for t in row), flush=True)
