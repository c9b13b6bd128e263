"""Where the time to first token goes: a batch-1 prefill timed end to end (wall) against the GPU
time of its kernels, then a Python profile of one; on a random-weight shape, or with shape
"default" on the default model and its shipped drafter.

    [PREFILL_GRAPHS=0] python benchmarks/profile_prefill.py [shape|default] [spec] [prompt_len ...]     (CUDA)
"""
import cProfile
import os
import pstats
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from drafttree.engine.engine import Engine, EngineConfig
from drafttree.sampling import SamplingParams

shape = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m"
spec = sys.argv[2] if len(sys.argv) > 2 else "ddtree"
lens = [int(n) for n in sys.argv[3:]] or [64, 200, 500]
extra = dict(block_size=16, budget=32) if spec != "none" else {}
weights = {} if shape == "default" else dict(random_weights=shape)
graphs = os.environ.get("PREFILL_GRAPHS", "1") == "1"   # PREFILL_GRAPHS=0: the eager prefill
eng = Engine(EngineConfig(spec=spec, max_num_seqs=1, max_model_len=2048, prefill_graphs=graphs, **weights, **extra))
r = eng.runner
sp = [SamplingParams(temperature=0.0)]


def prefill(n: int) -> None:
    r.prefill_rows([list(range(1, n + 1))], sp, [0])   # ends in the prefill's one host sync


with torch.inference_mode():
    print(f"{shape}, spec {spec}: prefill of one request (ms)")
    for n in lens:
        t0 = time.perf_counter()
        prefill(n)   # graphed: the capture of this length bucket
        first = (time.perf_counter() - t0) * 1e3
        for _ in range(2):
            prefill(n)
        t0 = time.perf_counter()
        for _ in range(5):
            prefill(n)
        wall = (time.perf_counter() - t0) / 5 * 1e3
        gpu = float("nan")
        if torch.cuda.is_available():
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                prefill(n)
            gpu = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
        print(f"  {n:5d} tokens: wall {wall:7.2f}   GPU kernels {gpu:7.2f}   first call {first:8.1f}", flush=True)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(5):
        prefill(lens[-1])
    pr.disable()
    print(f"\nPython profile, 5 prefills of {lens[-1]} tokens")
    st = pstats.Stats(pr)
    st.sort_stats("tottime").print_stats(25)
    st.sort_stats("cumulative").print_stats(30)
