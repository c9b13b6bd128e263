"""The target's sampler alone, graphed: `pick_tokens` with its compiled piece (`sample_rows`)
against all torch ops (DRAFTTREE_COMPILE=0 for that call), µs per call, for the shapes a round
hands it, unfiltered (SAMPLE) and with top-p (FILTERED).

    python benchmarks/sampler_bench.py [--out results.json]      (CUDA)
"""
import argparse
import json
import os

import torch

from drafttree.bench.graph_timer import graphed_us
from drafttree.sampling import SampleMode, SamplingTensors, pick_tokens


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="1x1x49152,1x32x49152,4x32x49152,16x32x49152,1x33x151936")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    rows = []
    print(f"{'R x N x V':<14} {'mode':<9} {'torch ops us':>12} {'compiled us':>12} {'same picks':>10}")
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
            os.environ["DRAFTTREE_COMPILE"] = "0"
            eager, want = graphed_us(call), call()
            os.environ["DRAFTTREE_COMPILE"] = "1"
            compiled, got = graphed_us(call), call()
            same = float((got == want).float().mean())
            rows.append({"shape": shape, "mode": mode.name, "torch_ops_us": eager, "compiled_us": compiled,
                         "same_picks": same})
            print(f"{shape:<14} {mode.name:<9} {eager:>12.1f} {compiled:>12.1f} {same:>10.3f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
