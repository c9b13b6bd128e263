"""The target's sampler alone, graphed: `pick_tokens` with its compiled piece (`sample_rows`)
against all torch ops (`settings.compile` "0" for that call, and top-k / top-p thresholds by a
sort), µs per call, for the shapes a round hands it, unfiltered (SAMPLE) and with top-p (FILTERED).
For FILTERED also the compiled piece after thresholds found by the sort (`sampling.filter_thresholds`
patched to `torch_ops.thresholds_by_sort`, the torch ops' way) instead of the radix-descent kernel
(`filter_kernel`).

    python benchmarks/sampler_bench.py [--out results.json]      (CUDA)
"""
import argparse
import json

import torch

from drafttree import sampling
from drafttree.bench.graph_timer import graphed_us
from drafttree.kernels.torch_ops import thresholds_by_sort
from drafttree.sampling import SampleMode, SamplingTensors, pick_tokens
from drafttree.settings import using


def by_sort(logits: torch.Tensor, st: SamplingTensors, pos: torch.Tensor) -> torch.Tensor:
    """`pick_tokens(..., FILTERED)` with the thresholds of the sort (captured so: the graph keeps it)."""
    kernel, sampling.filter_thresholds = sampling.filter_thresholds, thresholds_by_sort
    try:
        return pick_tokens(logits, st, pos, SampleMode.FILTERED)
    finally:
        sampling.filter_thresholds = kernel


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="1x1x49152,1x32x49152,4x32x49152,16x32x49152,1x33x151936")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    rows = []
    print(f"{'R x N x V':<14} {'mode':<9} {'torch ops us':>12} {'sorted us':>10} {'compiled us':>12}",
          f"{'same picks':>10}")
    for shape in a.shapes.split(","):
        R, N, V = map(int, shape.split("x"))
        g = torch.Generator(device="cuda").manual_seed(0)
        logits = torch.randn(R, N, V, device="cuda", generator=g) * 3
        st = SamplingTensors.empty(R, "cuda")
        st.temperature.fill_(0.8)
        st.top_p.fill_(0.95)
        st.seed.copy_(torch.arange(R) + 7)
        pos = torch.arange(N, device="cuda")[None, :] + 100 + torch.arange(R, device="cuda")[:, None]
        for mode in (SampleMode.SAMPLE, SampleMode.FILTERED):
            def call(mode: SampleMode = mode) -> torch.Tensor:
                return pick_tokens(logits, st, pos, mode)
            eager_call = call if mode is SampleMode.SAMPLE else (lambda: by_sort(logits, st, pos))
            with using(compile="0"):
                eager, want = graphed_us(eager_call), eager_call()
            sort = graphed_us(eager_call) if mode is SampleMode.FILTERED else None
            compiled, got = graphed_us(call), call()
            same = float((got == want).float().mean())
            rows.append({"shape": shape, "mode": mode.name, "torch_ops_us": eager, "sorted_us": sort,
                         "compiled_us": compiled, "same_picks": same})
            sorted_col = f"{sort:>10.1f}" if sort is not None else f"{'-':>10}"
            print(f"{shape:<14} {mode.name:<9} {eager:>12.1f} {sorted_col} {compiled:>12.1f} {same:>10.3f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
