"""Batched admission under load (EngineConfig.admit_min): prefill calls, rounds and tokens/s for
many requests through a full cache, on a tiny random model (host-side costs dominate).

Usage: python benchmarks/admission.py [--rows 128] [--requests 1024] [--device cpu]
"""
import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from drafttree import LLM, SamplingParams  # noqa: E402
from drafttree.tiny_target import make_target  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--rows", type=int, default=128)
p.add_argument("--requests", type=int, default=1024)
p.add_argument("--device", default="cpu")
a = p.parse_args()
target = make_target(Path(tempfile.mkdtemp()) / "t", "llama", vocab=97, layers=2)
rng = random.Random(0)
prompts = [[rng.randrange(96) for _ in range(rng.randint(20, 120))] for _ in range(a.requests)]
params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(16, 96), ignore_eos=True) for _ in prompts]
results = {}
for admit in (1, max(1, a.rows // 8)):
    llm = LLM(model=str(target), spec="none", device=a.device, max_num_seqs=a.rows, max_model_len=256,
              admit_min=admit)
    calls = [0]

    def counted(*args, real=llm.engine.runner.prefill, **kw):
        calls[0] += 1
        return real(*args, **kw)
    llm.engine.runner.prefill = counted
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    toks = sum(len(o.token_ids) for o in outs)
    results[admit] = [o.token_ids for o in outs]
    print(f"admit_min={admit}: {toks} tokens in {dt:.2f} s = {toks / dt:.0f} tok/s, {calls[0]} prefill calls, "
          f"{llm.engine.stats.rounds} rounds ({torch.get_num_threads()} threads, {a.device})")
first, *rest = results.values()
print("same tokens:", all(r == first for r in rest))
