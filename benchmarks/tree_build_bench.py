"""The DDTree build on the H200, by part: the vocabulary top-K (chunk kernel + merge,
`kernels/topk_kernel.py`), the whole build (top-K + `kernels/tree_kernel.py`) and plain torch ops
(`build_tree`), on draft logits [1, 15, 151,936] bf16 (Qwen3-8B's vocabulary, block 16); each
timed as a CUDA graph of 50 calls. The num_warps of the top-K's two kernels can be swept.

Two kinds of logits: Gaussian, and "clustered" (six runs of 192 consecutive ids per position
lifted by 6), because real logits cluster by token id and a top-K filter tuned on Gaussian
logits alone can fall back to whole-chunk sorts on them (run 11).

    python benchmarks/tree_build_bench.py [--budgets 32,128,512] [--logits gaussian,clustered]
                                          [--chunk-warps 4,8] [--merge-warps 4]   (CUDA)

Run 8 (benchmarks/results/2026-11-30_h200_run8.md) also swept the tree kernel's num_warps and a
rank-by-count level selection; both lost to the 4-warp bitonic network and were removed.
"""
import argparse

import torch

from drafttree.bench.graph_timer import graphed_us
from drafttree.kernels import topk_kernel
from drafttree.kernels.dispatch import build_tree_fused, top_log_probs
from drafttree.spec_decode.tree import build_tree

ap = argparse.ArgumentParser()
ap.add_argument("--budgets", default="32,128,512")
ap.add_argument("--logits", default="gaussian,clustered")
ap.add_argument("--merge-warps", default=str(topk_kernel.MERGE_WARPS))
ap.add_argument("--chunk-warps", default=str(topk_kernel.CHUNK_WARPS))
args = ap.parse_args()


def draft_logits(kind: str, V: int = 151936) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 15, V, generator=g) * 4
    if kind == "clustered":
        for p in range(15):
            for s in torch.randint(0, V - 192, (6,), generator=g).tolist():
                x[0, p, s:s + 192] += 6
    return x.to(torch.bfloat16).cuda()


logits = {kind: draft_logits(kind) for kind in args.logits.split(",")}
root = torch.zeros(1, dtype=torch.long, device="cuda")
default_warps = topk_kernel.MERGE_WARPS, topk_kernel.CHUNK_WARPS
for (kind, x), B in ((kx, int(b)) for kx in logits.items() for b in args.budgets.split(",")):
    print(f"{kind} logits, budget {B} (us per call)")
    for cw in (int(v) for v in args.chunk_warps.split(",")):
        for w in (int(v) for v in args.merge_warps.split(",")):
            topk_kernel.MERGE_WARPS, topk_kernel.CHUNK_WARPS = w, cw
            print(f"  top-K (chunk kernel at {cw} warps + merge at {w}): {graphed_us(lambda: top_log_probs(x, B)):7.1f}")
    topk_kernel.MERGE_WARPS, topk_kernel.CHUNK_WARPS = default_warps
    print(f"  whole build (top-K + tree kernel):              {graphed_us(lambda: build_tree_fused(x, root, B)):7.1f}")
    print(f"  plain torch ops (build_tree):                   {graphed_us(lambda: build_tree(x, root, B)):7.1f}",
          flush=True)
