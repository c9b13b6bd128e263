"""Few-row attention on the Qwen3-8B shape (8 KV heads, 4 query heads each, head dim 128, bf16):
the Triton kernel at several split targets (q token-major) against cuBLAS matmuls around a fused
softmax (q already head-major: the permute copies the model needs for it are not timed), and
the one-launch KV write against two indexed assignments; each timed as a CUDA graph of 50 calls.

    python benchmarks/attn_kernel_bench.py     (CUDA)
"""
import torch

from drafttree.bench.graph_timer import graphed_us
from drafttree.kernels import attn_kernel
from drafttree.kernels import torch_ops

Hkv, g, hd, L, SEEN = 8, 4, 128, 1024, 513
dev, dt = "cuda", torch.bfloat16


print(f"{'shape':>22} {'cuBLAS+softmax':>15} " + " ".join(f"{'tgt ' + str(t):>9}" for t in (132, 264, 528, 1056))
      + f" {'write idx':>10} {'write 1':>8}  (us per call)")
for B, W in ((1, 1), (1, 33), (16, 1), (16, 33), (32, 17)):
    kc = torch.randn(B, Hkv, 2048, hd, device=dev, dtype=dt)
    vc = torch.randn_like(kc)
    q = torch.randn(B, W, Hkv * g, hd, device=dev, dtype=dt)     # token-major, as the model has it
    q_heads = q.view(B, W, Hkv, g, hd).permute(0, 2, 3, 1, 4).reshape(B, Hkv, g * W, hd)
    mask = torch.zeros(B, 1, W, L, dtype=torch.bool, device=dev)
    mask[..., :SEEN] = True
    k, v = kc[:, :, :L], vc[:, :, :L]
    grouped = mask.expand(B, g, W, L).reshape(B, 1, g * W, L)
    row = [graphed_us(lambda: torch_ops.small_attention(q_heads, k, v, grouped, hd ** -0.5))]
    for t in (132, 264, 528, 1056):
        attn_kernel.TARGET_PROGRAMS = t
        row.append(graphed_us(lambda: attn_kernel.few_row_attention(q, k, v, mask, hd ** -0.5)))
    nk = torch.randn(B, W, Hkv, hd, device=dev, dtype=dt)
    rows = torch.arange(B, device=dev)[:, None]
    slots = (SEEN - 1 + torch.arange(W, device=dev)).expand(B, W).contiguous()

    def idx():
        kc[rows, :, slots] = nk
        vc[rows, :, slots] = nk
    row.append(graphed_us(idx))
    row.append(graphed_us(lambda: attn_kernel.write_kv(kc, vc, rows, slots, nk, nk)))
    print(f"{f'B={B} W={W} rows={g * W}':>22} " + " ".join(f"{x:9.2f}" for x in row))
