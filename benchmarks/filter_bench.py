"""Top-k / top-p thresholds alone, graphed: the radix-descent kernel (`filter_kernel`) at several
chunk sizes (entries per program) against the sort (`thresholds_by_sort`), µs per call, and the
chunk the code plans, on logits `randn * 3` and on peaked ones (a language model's shape: 40
logits 14-20 above a `randn * 2` bulk). Every chunking must give the sort's thresholds.

    python benchmarks/filter_bench.py [--chunks 1024,2048,4096,8192,16384] [--out results.json]   (CUDA)
"""
import argparse
import json

import torch

from drafttree.kernels import filter_kernel
from drafttree.bench.graph_timer import graphed_us
from drafttree.kernels.torch_ops import thresholds_by_sort

CASES = {"top-p": (0.8, 0, 0.95), "top-k+top-p": (0.8, 50, 0.9), "top-k": (1.0, 40, 1.0)}


def make_logits(dist: str, R: int, N: int, V: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(0)
    if dist == "randn":
        return (torch.randn(R, N, V, device="cuda", generator=g) * 3).bfloat16()
    x = torch.randn(R, N, V, device="cuda", generator=g) * 2
    x[..., :40] += 14 + torch.rand(R, N, 40, device="cuda", generator=g) * 6
    return x.bfloat16()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="1x1x49152,1x1x151936,1x33x151936,4x32x49152,16x32x49152")
    p.add_argument("--chunks", default="1024,2048,4096,8192,16384")
    p.add_argument("--cases", default="top-p,top-k+top-p")
    p.add_argument("--dists", default="randn,peaked")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    chunks = [int(c) for c in a.chunks.split(",")]
    rows = []
    print(f"{'R x N x V':<14} {'logits':<7} {'case':<12} {'sort us':>8} {'planned':>12} "
          + " ".join(f"{c:>8}" for c in chunks))
    for shape in a.shapes.split(","):
        R, N, V = map(int, shape.split("x"))
        for dist, case in [(d, c) for d in a.dists.split(",") for c in a.cases.split(",")]:
            logits = make_logits(dist, R, N, V)
            T, k, top_p = CASES[case]
            temp = torch.full((R,), T, device="cuda")
            top_k = torch.full((R,), k, dtype=torch.long, device="cuda")
            pp = torch.full((R,), top_p, device="cuda")
            want = thresholds_by_sort(logits, temp, top_k, pp)
            sort_us = graphed_us(lambda: thresholds_by_sort(logits, temp, top_k, pp), n=10)
            times, same = {}, True
            for c in [None, *chunks]:
                def call(c: int | None = c) -> torch.Tensor:
                    return filter_kernel.filter_thresholds_fused(logits, temp, top_k, pp, chunk=c)
                times[c] = graphed_us(call)
                same &= bool(torch.equal(call(), want))
            nc, ch = filter_kernel.chunk_plan(R * N, V)
            rows.append({"shape": shape, "logits": dist, "case": case, "sort_us": sort_us, "planned_chunk": ch,
                         "planned_us": times[None], "chunk_us": {str(c): times[c] for c in chunks},
                         "same_thresholds": same})
            print(f"{shape:<14} {dist:<7} {case:<12} {sort_us:>8.1f} {times[None]:>6.1f}@{ch:<5} "
                  + " ".join(f"{times[c]:>8.1f}" for c in chunks) + ("" if same else "  DIFFERENT THRESHOLDS"))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
