"""The DDTree build on the H200, by part and by num_warps: the vocabulary top-K (chunk kernel +
merge, `spec/topk_kernel.py`) and the tree kernel (`spec/tree_kernel.py`) on draft logits
[1, 15, 151,936] bf16 (Qwen3-8B's vocabulary, block 16); each timed as a CUDA graph of 50 calls.
Every variant's tree must equal the default's.

    python benchmarks/tree_build_bench.py [--budgets 32,128] [--tree-warps 1,2,4] [--merge-warps 1,2,4]
                                          [--select bitonic,rank]   (CUDA)

"rank" is the tree kernel's rank-by-count level selection (tree_kernel.RANK_SELECT), which
applies up to tree_kernel.RANK_MAX_PAIRS padded pairs (budget 32; not 128).
"""
import argparse

import torch

from drafttree.bench.graph_timer import graphed_us
from drafttree.spec import topk_kernel, tree_kernel
from drafttree.spec.tree import top_log_probs
from drafttree.spec.tree_kernel import build_tree_fused

ap = argparse.ArgumentParser()
ap.add_argument("--budgets", default="32,128")
ap.add_argument("--tree-warps", default="1,2,4")
ap.add_argument("--merge-warps", default="1,2,4")
ap.add_argument("--select", default="bitonic,rank")
args = ap.parse_args()

x = torch.randn(1, 15, 151936, device="cuda").mul_(4).to(torch.bfloat16)
root = torch.zeros(1, dtype=torch.long, device="cuda")
for B in (int(b) for b in args.budgets.split(",")):
    ref = build_tree_fused(x, root, B)
    print(f"budget {B} (us per call)")
    for w in (int(v) for v in args.merge_warps.split(",")):
        topk_kernel.MERGE_WARPS = w
        print(f"  top-K (chunk kernel + merge), merge at {w} warps: {graphed_us(lambda: top_log_probs(x, B)):7.1f}")
    topk_kernel.MERGE_WARPS = 4
    for sel in args.select.split(","):
        tree_kernel.RANK_SELECT = sel == "rank"
        for w in (int(v) for v in args.tree_warps.split(",")):
            tree_kernel.TREE_WARPS = w
            got = build_tree_fused(x, root, B)
            same = all(torch.equal(getattr(got, f), getattr(ref, f))
                       for f in ("tokens", "parents", "depth", "valid", "visible"))
            print(f"  whole build, {sel} selection, tree kernel at {w} warps: "
                  f"{graphed_us(lambda: build_tree_fused(x, root, B)):7.1f}   same tree: {same}", flush=True)
    tree_kernel.TREE_WARPS, tree_kernel.RANK_SELECT = None, False
