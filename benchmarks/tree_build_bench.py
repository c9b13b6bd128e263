"""The DDTree build on the H200, by part: the vocabulary top-K (chunk kernel + merge,
`spec/topk_kernel.py`), the whole build (top-K + `spec/tree_kernel.py`) and plain torch ops
(`build_tree`), on draft logits [1, 15, 151,936] bf16 (Qwen3-8B's vocabulary, block 16); each
timed as a CUDA graph of 50 calls. The top-K merge's num_warps can be swept.

    python benchmarks/tree_build_bench.py [--budgets 32,128,512] [--merge-warps 4]   (CUDA)

Run 8 (benchmarks/results/2026-11-30_h200_run8.md) also swept the tree kernel's num_warps and a
rank-by-count level selection; both lost to the 4-warp bitonic network and were removed.
"""
import argparse

import torch

from drafttree.bench.graph_timer import graphed_us
from drafttree.spec import topk_kernel
from drafttree.spec.tree import build_tree, top_log_probs
from drafttree.spec.tree_kernel import build_tree_fused

ap = argparse.ArgumentParser()
ap.add_argument("--budgets", default="32,128,512")
ap.add_argument("--merge-warps", default=str(topk_kernel.MERGE_WARPS))
args = ap.parse_args()

x = torch.randn(1, 15, 151936, device="cuda").mul_(4).to(torch.bfloat16)
root = torch.zeros(1, dtype=torch.long, device="cuda")
default_warps = topk_kernel.MERGE_WARPS
for B in (int(b) for b in args.budgets.split(",")):
    print(f"budget {B} (us per call)")
    for w in (int(v) for v in args.merge_warps.split(",")):
        topk_kernel.MERGE_WARPS = w
        print(f"  top-K (chunk kernel + merge), merge at {w} warps: {graphed_us(lambda: top_log_probs(x, B)):7.1f}")
    topk_kernel.MERGE_WARPS = default_warps
    print(f"  whole build (top-K + tree kernel):              {graphed_us(lambda: build_tree_fused(x, root, B)):7.1f}")
    print(f"  plain torch ops (build_tree):                   {graphed_us(lambda: build_tree(x, root, B)):7.1f}",
          flush=True)
