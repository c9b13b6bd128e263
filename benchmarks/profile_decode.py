"""Kernel-level profile of graphed rounds (which kernels dominate a decode step or a DDTree round).

    python benchmarks/profile_decode.py [shape] [none|ddtree] [fp8]     (CUDA; random weights; fp8:
                                                                        the drafter's weights)
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from drafttree.engine.engine import Engine, EngineConfig
from drafttree.sampling import SampleMode, SamplingParams

shape = sys.argv[1] if len(sys.argv) > 1 else "qwen3-8b"
spec = sys.argv[2] if len(sys.argv) > 2 else "none"
extra = dict(block_size=16, budget=32) if spec == "ddtree" else {}
if len(sys.argv) > 3:
    extra["draft_quantization"] = sys.argv[3]
eng = Engine(EngineConfig(spec=spec, random_weights=shape, max_num_seqs=1, max_model_len=2048, **extra))
r = eng.runner
r.prefill_rows([list(range(1, 513))], [SamplingParams(temperature=0.0)], [0])
state = (r.state.start, r.state.bonus, r.state.ctx_n, r.state.ctx_feat)
snap = [t.clone() for t in state]
ROUNDS = 5
with torch.inference_mode():
    def rounds():
        for _ in range(ROUNDS):
            for t, v in zip(state, snap):   # every round from the same prefix
                t.copy_(v)
            r.run_round(1, SampleMode.GREEDY, 512)
        torch.cuda.synchronize()
    rounds()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        rounds()
drafter = extra.get("draft_quantization") or "bf16"
print(f"{shape}, spec {spec}, drafter {drafter}, {ROUNDS} graphed rounds at batch 1, KV bucket {r.round_kv_len(512)}")
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=45, max_name_column_width=90))
