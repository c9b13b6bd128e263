"""Few-row attention matmuls on the H200: KV cache token-major [rows, L, Hkv, hd] vs head-major
[rows, Hkv, L, hd], and the two operand orders of QK^T. Prints microseconds per call."""
import torch

def timed(fn, iters=200):
    for _ in range(10):
        fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); s.record()
    for _ in range(iters):
        fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / iters * 1000

dev, dt, hkv, hd, g = "cuda", torch.bfloat16, 8, 128, 4
print(f"{'B':>3} {'rows':>4} {'L':>5}  tokmaj_qk tokmaj_kq headmaj_qk headmaj_kq  tokmaj_pv headmaj_pv  (us)")
for B in (1, 8, 16):
    for W in (1, 33):
        for L in (1024, 2048, 4096):
            tok = torch.randn(B, 4096, hkv, hd, device=dev, dtype=dt)
            head = torch.randn(B, hkv, 4096, hd, device=dev, dtype=dt)
            q = torch.randn(B, hkv, g * W, hd, device=dev, dtype=dt)
            p = torch.randn(B, hkv, g * W, L, device=dev, dtype=dt)
            kt = tok[:, :L].transpose(1, 2)
            kh = head[:, :, :L]
            r = [timed(lambda: q @ kt.transpose(-1, -2)), timed(lambda: (kt @ q.transpose(-1, -2)).transpose(-1, -2)),
                 timed(lambda: q @ kh.transpose(-1, -2)), timed(lambda: (kh @ q.transpose(-1, -2)).transpose(-1, -2)),
                 timed(lambda: p @ kt), timed(lambda: p @ kh)]
            print(f"{B:>3} {g*W:>4} {L:>5}  " + " ".join(f"{x:9.1f}" for x in r), flush=True)
