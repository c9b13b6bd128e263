"""Kernel-level profile of one eager decode step (which kernels dominate)."""
import sys
import torch
from torch.profiler import ProfilerActivity, profile
from drafttree.engine.engine import Engine, EngineConfig
from drafttree.sampling import SamplingParams
from drafttree.spec import rounds

shape = sys.argv[1] if len(sys.argv) > 1 else "qwen3-8b"
eng = Engine(EngineConfig(spec="none", random_weights=shape, max_num_seqs=1, max_model_len=2048, cuda_graphs=False))
r = eng.runner
r.prefill(0, [list(range(1, 513))], [SamplingParams(temperature=0.0)], [0])
L = r.cache_cfg.max_len
with torch.inference_mode():
    for _ in range(3):
        r.state.start[0] = 512
        rounds.decode_round(r, 1, L, True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            r.state.start[0] = 512
            rounds.decode_round(r, 1, L, True)
        torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=90))
