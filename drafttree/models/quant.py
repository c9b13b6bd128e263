"""fp8 weight-only projections for the drafter (`--draft-quantization fp8`).

A DDTree round of Qwen3-8B's shape reads 3.3 GB for its drafter (1.2 GB of it the LM head it
borrows from the target) beside the target's 15.1, at a draft block's 16 rows. Each weight row
is stored as float8 e4m3 with one fp32 scale (its absmax maps to 448); `gemm_kernel`'s tiles load
the e4m3 values, convert them to f16 (exact: e4m3 fits in f16 and bf16), run the tensor-core dot
with the activations in f16 and multiply each output by its row's scale (`gemm_kernel.FP8_DOTS`).
Without the kernels (CPU, fp32) the weights are widened back for the torch ops (`dispatch.fp8_linear`).

On the Qwen3-8B shape the DDTree round takes 6.17-6.23 ms against 6.41-6.48 with the bf16
drafter (H200); on the small SmolLM2 drafter the draft phase is slower (0.193 against 0.181 ms),
so the option is off by default. Only the drafter is quantized: its tokens are proposals that
the target verifies, so the output stays exactly plain decoding's; only the acceptance can move
(benchmarks/results/2026-12-02_cpu_fp8_drafter_tau.md).
"""
from __future__ import annotations

import torch
from torch import nn

from drafttree.kernels import dispatch
from drafttree.kernels.torch_ops import dequantize  # noqa: F401  (quantize_rows' inverse, for callers)
from drafttree.parallel.layers import GatheredLogits, VocabParallelHead

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
METHODS = ("fp8",)


def quantize_rows(w: torch.Tensor, chunk: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """(w as e4m3 [N, K], fp32 scales [N]) with w ~ q * scale[:, None]: each row's absmax -> 448.
    `chunk` rows at a time, so that an LM head's fp32 copies stay small."""
    q = torch.empty(w.shape, dtype=FP8, device=w.device)
    scale = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    for i in range(0, w.shape[0], chunk):
        rows = w[i:i + chunk].float()
        scale[i:i + chunk] = rows.abs().amax(dim=1).clamp(min=1e-12) / E4M3_MAX
        q[i:i + chunk] = (rows / scale[i:i + chunk, None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return q, scale


def check(method: str, device: torch.device | str) -> None:
    """Refuse a quantization this code does not know, or fp8 on a device that cannot run it: CUDA
    needs Triton's e4m3 conversion (compute capability 8.9 or newer); elsewhere the weights are
    widened for the torch ops."""
    if method not in METHODS:
        raise ValueError(f"unknown draft quantization {method!r}; choose one of {list(METHODS)}")
    if not dispatch.fp8_runs_on(device):
        raise ValueError(f"fp8 drafter weights need Triton and compute capability 8.9 or newer on {device}")


class Fp8Linear(nn.Module):
    """nn.Linear's forward from e4m3 weights [N, K] and a scale per row (`quantize_rows`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        q, scale = quantize_rows(weight)
        self.register_buffer("weight", q)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", bias)
        self.out_features, self.in_features = weight.shape

    @classmethod
    def of(cls, lin: nn.Linear) -> "Fp8Linear":
        return cls(lin.weight.detach(), None if lin.bias is None else lin.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.fp8_linear(x, self.weight, self.bias, self.scale)


def weight_scale(lin: nn.Module) -> torch.Tensor | None:
    """The per-row scales of an Fp8Linear's weight; None for a 16- or 32-bit nn.Linear."""
    return lin.scale if isinstance(lin, Fp8Linear) else None


PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def quantize_drafter(drafter: nn.Module, method: str) -> None:
    """Replace the drafter's fc and every layer's projections by Fp8Linear, and give it an fp8 copy
    of the target's LM head for its draft logits (the target keeps its own)."""
    check(method, drafter.fc.weight.device)
    parents = [(drafter, "fc")] + [(getattr(layer, path.split(".")[0]), path.split(".")[1])
                                   for layer in drafter.layers for path in PROJECTIONS]
    for parent, name in parents:
        setattr(parent, name, Fp8Linear.of(getattr(parent, name)))
    lm_head = drafter.lm_head
    head = lm_head.weight
    fp8 = Fp8Linear(head.detach())   # a vocabulary-parallel head's rows, gathered as the head gathers
    drafter.__dict__["draft_head"] = GatheredLogits(fp8, lm_head) if isinstance(lm_head, VocabParallelHead) else fp8
    if head.is_cuda:   # the replaced 16-bit weights back to the device, before the KV cache is sized
        torch.cuda.empty_cache()
