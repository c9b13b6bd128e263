"""Kernel times (profiler) of the decode QK^T/PV matmuls, token-major vs head-major cache, batch 1."""
import torch
from torch.profiler import ProfilerActivity, profile
dt = torch.bfloat16
for L in (1024, 2048):
    tok = torch.randn(1, 4096, 8, 128, device="cuda", dtype=dt); head = tok.transpose(1, 2).contiguous()
    q = torch.randn(1, 8, 4, 128, device="cuda", dtype=dt); p = torch.randn(1, 8, 4, L, device="cuda", dtype=dt)
    for name, k in (("tokmaj", tok[:, :L].transpose(1, 2)), ("headmaj", head[:, :, :L])):
        for _ in range(5):
            q @ k.transpose(-1, -2); p @ k
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                q @ k.transpose(-1, -2); p @ k
            torch.cuda.synchronize()
        print(L, name, [(e.key[:50], round(e.device_time_total / e.count, 1)) for e in prof.key_averages()], flush=True)
