"""Block-scaled fp8 weights' kernels (`kernels/fp8_block_kernel.py`, `kernels/fp8_block_moe.py`)
against their torch forms (`kernels/fp8_block_ops.py`), and `dispatch`'s choice between them.

Without CUDA the kernels run under Triton's interpreter at tiny shapes, in fp32 and fp16 (the
interpreter converts e4m3, but does not emulate bf16 dots); a GPU also runs bf16 at DeepSeek-V3 /
Kimi K2 shapes and the grouped kernels in a CUDA graph. A sm_90 compile of every block class runs
on the CPU too. Each weight block is scaled by its own power of two (2^-6 to 2^6; experts 2^-3 to
2^3), so a product that takes another block's scale is far off; every `torch.empty` is filled
with NaN, so an output element a kernel leaves unwritten shows.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from drafttree.kernels import dispatch, fp8_block_kernel, fp8_block_moe, fp8_block_ops, moe_kernel
from drafttree.kernels.torch_ops import silu_mul
from tests import compile_fp8_blocks
from tests.helpers import DEVICE, ON_CPU, TRITON_REASON, gpu, interpreted_on_cpu

pytest.importorskip("triton", reason=TRITON_REASON)

LinearBlocks = fp8_block_kernel.Blocks
Q = (128, 128)   # DeepSeek-V3's and Kimi K2's blocks


@pytest.fixture(autouse=True)
def _kernel_device(monkeypatch: pytest.MonkeyPatch) -> None:
    interpreted_on_cpu(monkeypatch)


@pytest.fixture
def poisoned(monkeypatch: pytest.MonkeyPatch) -> None:
    """`torch.empty` of a floating dtype returns NaNs (the kernels' outputs, partial sums and
    intermediates)."""
    empty = torch.empty

    def nan_empty(*args, **kw):
        t = empty(*args, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    monkeypatch.setattr(torch, "empty", nan_empty)


def fp8_weight(N: int, K: int, block: tuple[int, int], lead: tuple[int, ...] = (), seed: int = 0,
               spread: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """Random [*lead, N, K] weights (entries ~ 1/sqrt(K)) with each block scaled by 2^-spread to
    2^spread, quantized: (e4m3, scale_inv) on DEVICE. Made one leading index at a time (on the
    device: the experts of a GPU case are gigabytes in fp32)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    rows, cols = -(-N // block[0]), -(-K // block[1])
    qs, ss = [], []
    for _ in range(torch.Size(lead).numel()):
        w = torch.randn(N, K, generator=g, device=DEVICE) / K ** 0.5
        f = 2.0 ** torch.randint(-spread, spread + 1, (rows, cols), generator=g, device=DEVICE).float()
        w *= f.repeat_interleave(block[0], 0)[:N].repeat_interleave(block[1], 1)[:, :K]
        q, s = fp8_block_ops.quantize(w, block)
        qs.append(q)
        ss.append(s)
    return torch.stack(qs).view(*lead, N, K), torch.stack(ss).view(*lead, rows, cols)


def activations(M: int, K: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(M, K, generator=g, device=DEVICE).to(dtype)


def assert_rounded_once(got: torch.Tensor, exact: torch.Tensor) -> None:
    """got is `exact` (fp32) rounded once to got's dtype, up to fp32 sums in another order: within
    one unit in the last place (twice the rounding) plus 1e-4 of the largest output (1e-5 in fp32)."""
    top = exact.abs().max().item()
    rel = 1e-5 if got.dtype == torch.float32 else torch.finfo(got.dtype).eps
    torch.testing.assert_close(got.float(), exact, rtol=rel, atol=(1e-5 if got.dtype == torch.float32 else 1e-4) * top)


def assert_near_torch_form(got: torch.Tensor, want: torch.Tensor) -> None:
    """Against the torch form in the same dtype, which rounds each dequantized weight (and the
    products) to it, and so strays further from the exact result than the kernels: the largest
    difference within 4 units in the last place of the largest output."""
    tol = 1e-5 if got.dtype == torch.float32 else 4 * torch.finfo(got.dtype).eps
    assert got.shape == want.shape and got.dtype == want.dtype
    assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()


# -- quantize ---------------------------------------------------------------------------------------


def test_quantize_fills_each_block_to_e4m3s_largest_value():
    """Edge blocks too: each block's largest magnitude becomes 448, an all-zero block keeps scale
    1, and dequantize gives the weight back to e4m3's precision."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(2, 20, 36, generator=g) * torch.logspace(-3, 3, 36)
    w[0, 16:, 32:] = 0.0   # the corner block of the first matrix
    q, s = fp8_block_ops.quantize(w, (8, 16))
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and s.shape == (2, 3, 3)
    amax = F.pad(q.float().abs(), (0, 12, 0, 4)).view(2, 3, 8, 3, 16).amax(dim=(2, 4))
    assert amax[0, 2, 2] == 0 and s[0, 2, 2] == 1
    amax[0, 2, 2] = 448
    assert torch.equal(amax, torch.full_like(amax, 448))
    back = fp8_block_ops.dequantize(q, s, (8, 16))
    step = s.repeat_interleave(8, 1)[:, :20].repeat_interleave(16, 2)[..., :36]
    assert ((back - w).abs() <= w.abs() * 2 ** -4 + step * 2 ** -10).all()


# -- the linear layer -------------------------------------------------------------------------------

# (M, N, K, block, blocks or None for the code's): edge blocks in N and K, a weight narrower than
# a block, forced splits, one split with bias, several token tiles under the runs of weight tiles.
CPU_LINEAR = [
    pytest.param(1, 40, 96, (16, 32), None, id="decode_edges"),
    pytest.param(5, 72, 200, (32, 64), LinearBlocks(16, 16, 64, 4, 2, 2, 3), id="split3_edge_k"),
    pytest.param(33, 48, 128, Q, None, id="verify_narrow"),
    pytest.param(70, 56, 80, (16, 16), LinearBlocks(16, 16, 32, 4, 2, 2, 1), id="5_token_tiles_runs_of_2"),
    pytest.param(3, 24, 160, (8, 32), LinearBlocks(16, 16, 128, 4, 2, 1, 0), id="bk_clamped_to_block"),
]
GPU_LINEAR = [gpu(M, N, K, Q, None, id=f"{M}x{K}->{N}")
              for N, K in ((18432, 7168), (576, 7168), (2112, 1536 + 64)) for M in (1, 8, 33, 528, 2048)]


def _linear_dtypes() -> list:
    return [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
            gpu(torch.bfloat16, id="bf16")]


def _check_linear(M, N, K, block, blocks, dtype, bias: bool) -> None:
    q, s = fp8_weight(N, K, block, seed=N + K)
    x = activations(M, K, dtype, seed=M)
    b = activations(1, N, dtype, seed=M + 1)[0] if bias else None
    with torch.no_grad():
        got = fp8_block_kernel.linear(x, q, s, block, b, blocks)
        exact = F.linear(x.float(), fp8_block_ops.dequantize(q, s, block), None if b is None else b.float())
        assert got.shape == (M, N) and got.dtype == dtype
        assert_rounded_once(got, exact)
        assert_near_torch_form(got, fp8_block_ops.linear(x, q, s, block, b))


@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize("dtype", _linear_dtypes())
@pytest.mark.parametrize("M,N,K,block,blocks", CPU_LINEAR)
def test_linear_matches_the_torch_form(M, N, K, block, blocks, dtype):
    _check_linear(M, N, K, block, blocks, dtype, bias=M % 2 == 1)


@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize("M,N,K,block,blocks", GPU_LINEAR)
def test_linear_matches_the_torch_form_at_deepseek_shapes(M, N, K, block, blocks):
    """bf16 at every phase's width: decode, a decode batch, a verify, a prefill chunk, a prefill;
    the dense MLP's gate/up, kv_a (576: 4.5 blocks) and an input edge block (1600 = 12.5)."""
    _check_linear(M, N, K, block, blocks, torch.bfloat16, bias=M == 33)


def test_linear_keeps_leading_dims_and_refuses_bad_operands():
    q, s = fp8_weight(24, 48, (16, 16))
    x = activations(6, 48, torch.float32, seed=1).view(2, 3, 48)
    with torch.no_grad():
        got = fp8_block_kernel.linear(x, q, s, (16, 16))
        assert got.shape == (2, 3, 24)
        torch.testing.assert_close(got, fp8_block_ops.linear(x, q, s, (16, 16)), atol=1e-5, rtol=1e-5)
        assert fp8_block_kernel.linear(x[:0], q, s, (16, 16)).shape == (0, 3, 24)
        with pytest.raises(ValueError, match="float8_e4m3fn"):
            fp8_block_kernel.linear(x, q.float(), s, (16, 16))
        with pytest.raises(ValueError, match="expected"):
            fp8_block_kernel.linear(x, q, s[:, :2], (16, 16))
        with pytest.raises(ValueError, match="inputs"):
            fp8_block_kernel.linear(x[..., :32], q, s, (16, 16))
        with pytest.raises(ValueError, match="bias"):
            fp8_block_kernel.linear(x, q, s, (16, 16), torch.zeros(23, device=DEVICE))
        with pytest.raises(ValueError, match="multiple of 16"):
            fp8_block_kernel.linear(x, q, fp8_block_ops.quantize(q.float(), (16, 8))[1], (16, 8))


# -- routed experts ---------------------------------------------------------------------------------


def routing(N: int, k: int, E: int, seed: int, elsewhere: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(w [N, k] fp32, idx [N, k]): k distinct experts per token, about `elsewhere` of the pairs
    on id E (another rank's experts)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    idx = torch.where(torch.rand(N, k, generator=g) < elsewhere, E, idx)
    return torch.rand(N, k, generator=g).to(DEVICE), idx.to(DEVICE)


def experts_case(N: int, k: int, E: int, D: int, I: int, block, dtype, elsewhere: float, seed: int = 0):
    gu, gus = fp8_weight(2 * I, D, block, (E,), seed=seed, spread=3)
    dn, dns = fp8_weight(D, I, block, (E,), seed=seed + 1, spread=3)
    w, idx = routing(N, k, E, seed, elsewhere)
    return activations(N, D, dtype, seed), w, idx, gu, gus, dn, dns


def experts_by_expert(x, w, idx, gu, gus, dn, dns, block) -> torch.Tensor:
    """`fp8_block_ops.experts`, one GEMM per expert hit instead of one GEMV per pair (its transient
    of N·k widened experts does not fit a prefill of DeepSeek's): the same rounding points."""
    N, k = idx.shape
    E = gu.shape[0]
    ys = torch.zeros(N, k, dn.shape[1], dtype=x.dtype, device=x.device)
    for e in idx.unique().tolist():
        if e == E:
            continue
        tok, j = (idx == e).nonzero(as_tuple=True)
        h = F.linear(x[tok], fp8_block_ops.dequantize(gu[e], gus[e], block, x.dtype))
        ys[tok, j] = F.linear(silu_mul(h), fp8_block_ops.dequantize(dn[e], dns[e], block, x.dtype))
    wk = torch.where(idx < E, w, torch.zeros_like(w)).to(x.dtype)
    return (ys * wk[..., None]).sum(dim=1)


SMALL = moe_kernel.Blocks(16, 16, 16, 16, 4, 2)   # several weight-row programs and input steps
# (N, k, E, D, I, block, blocks or None, share of pairs on another rank)
CPU_EXPERTS = [
    pytest.param(1, 4, 6, 48, 24, (16, 16), None, 0.3, id="decode_edges"),
    pytest.param(9, 2, 5, 80, 40, (32, 32), SMALL, 0.0, id="9rows_small_blocks_dropless"),
    pytest.param(20, 3, 4, 64, 48, (16, 32), moe_kernel.Blocks(32, 16, 32, 64, 4, 2), 0.4, id="bm32_bk_clamped"),
]
GPU_EXPERTS = [gpu(N, 8, 48, 7168, 2048, Q, None, 0.25, id=f"{N}rows") for N in (1, 8, 33, 528, 2048)]


def _check_experts(N, k, E, D, I, block, blocks, elsewhere, dtype) -> None:
    x, w, idx, gu, gus, dn, dns = experts_case(N, k, E, D, I, block, dtype, elsewhere, seed=N + E)
    dropless = elsewhere == 0.0
    with torch.no_grad():
        got = fp8_block_moe.fused_experts(x, w, idx, gu, gus, dn, dns, block, blocks, dropless=dropless)
        assert got.shape == (N, D) and got.dtype == dtype
        same = (fp8_block_ops.experts if N * k <= 64 else experts_by_expert)(x, w, idx, gu, gus, dn, dns, block)
        exact = experts_by_expert(x.float(), w, idx, gu, gus, dn, dns, block)
    if dtype == torch.float32:
        # fp32 sums in another order than the CPU's BLAS (whose own fp32 result is 1-3 units in the
        # last place of the largest output off fp64's here): against fp64, within 8 such units
        exact64 = experts_by_expert(x.double(), w, idx, gu, gus, dn, dns, block)
        assert (got.double() - exact64).abs().max() <= 8 * torch.finfo(dtype).eps * exact64.abs().max()
        return
    assert_near_torch_form(got, same)
    # the kernels round where the torch form does (h, each expert's output, the weighted sum)
    # but never a scaled weight: within 2 units in the last place of the largest output
    assert (got.float() - exact).abs().max() <= 2 * torch.finfo(dtype).eps * exact.abs().max()


@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize("dtype", _linear_dtypes())
@pytest.mark.parametrize("N,k,E,D,I,block,blocks,elsewhere", CPU_EXPERTS)
def test_experts_match_the_torch_form(N, k, E, D, I, block, blocks, elsewhere, dtype):
    _check_experts(N, k, E, D, I, block, blocks, elsewhere, dtype)


@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize("N,k,E,D,I,block,blocks,elsewhere", GPU_EXPERTS)
def test_experts_match_the_torch_form_at_deepseek_shapes(N, k, E, D, I, block, blocks, elsewhere):
    """bf16, DeepSeek-V3 / K2 experts (D 7168, I 2048, top-8) with 48 on this rank and a quarter of
    the pairs routed to others, at every phase's width."""
    _check_experts(N, k, E, D, I, block, blocks, elsewhere, torch.bfloat16)


def test_experts_by_expert_is_the_torch_form():
    """The GPU cases' reference, against the torch form it stands in for."""
    x, w, idx, gu, gus, dn, dns = experts_case(7, 3, 5, 32, 16, (16, 16), torch.float32, 0.3)
    torch.testing.assert_close(experts_by_expert(x, w, idx, gu, gus, dn, dns, (16, 16)),
                               fp8_block_ops.experts(x, w, idx, gu, gus, dn, dns, (16, 16)), atol=1e-5, rtol=1e-5)


def test_experts_read_nothing_back(monkeypatch):
    """The whole kernel path (layout and both GEMMs) with the read-back calls made to fail."""
    args = experts_case(12, 2, 7, 32, 16, (16, 16), torch.float16, 0.3)
    with torch.no_grad():
        want = fp8_block_moe.fused_experts(*args, (16, 16), dropless=False)

        def refuse(*a, **kw):
            raise AssertionError("read back to the host")
        for name in ("item", "tolist", "nonzero", "__bool__"):
            monkeypatch.setattr(torch.Tensor, name, refuse)
        monkeypatch.setattr(torch, "nonzero", refuse)
        got = fp8_block_moe.fused_experts(*args, (16, 16), dropless=False)
    monkeypatch.undo()
    assert torch.equal(got, want)


def test_experts_refuse_mismatched_operands():
    x, w, idx, gu, gus, dn, dns = experts_case(2, 2, 3, 32, 16, (16, 16), torch.float32, 0.0)
    with pytest.raises(ValueError, match="expected"):
        fp8_block_moe.fused_experts(x, w, idx, gu, gus[:, :1], dn, dns, (16, 16))
    with pytest.raises(ValueError, match="do not fit"):
        fp8_block_moe.fused_experts(x[:, :16], w, idx, gu, gus, dn, dns, (16, 16))


@pytest.mark.gpu
def test_grouped_experts_replay_in_a_cuda_graph():
    """Captured once at DeepSeek's expert shape, replayed with other routings (some pairs on other
    ranks) and inputs: the eager result each time, bit for bit."""
    N, k, E, D, I = 33, 8, 48, 7168, 2048
    x, w, idx, gu, gus, dn, dns = experts_case(N, k, E, D, I, Q, torch.bfloat16, 0.25)
    sx, sw, sidx = x.clone(), w.clone(), idx.clone()

    def run() -> torch.Tensor:
        return fp8_block_moe.fused_experts(sx, sw, sidx, gu, gus, dn, dns, Q, dropless=False)
    with torch.no_grad():
        run()   # compile before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        for seed, elsewhere in ((1, 0.0), (2, 0.25), (3, 0.9)):
            w2, idx2 = routing(N, k, E, seed, elsewhere)
            sx.copy_(activations(N, D, torch.bfloat16, seed))
            sw.copy_(w2)
            sidx.copy_(idx2)
            graph.replay()
            assert torch.equal(out, run()), seed


# -- dispatch ---------------------------------------------------------------------------------------


def test_dispatch_takes_the_kernels_where_they_run(set_settings, monkeypatch):
    """16-bit without autograd, a block width of 16s: the kernels (the grouped ones only where
    `moe_kernels`); fp32, autograd, an 8-wide block or the setting off: the torch forms."""
    calls: list[str] = []
    for mod, name in ((fp8_block_kernel, "linear"), (fp8_block_moe, "fused_experts"),
                      (fp8_block_ops, "linear"), (fp8_block_ops, "experts")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, real=real, tag=f"{mod.__name__.split('.')[-1]}.{name}", **kw:
                            calls.append(tag) or real(*a, **kw))
    dt = torch.float16 if ON_CPU else torch.bfloat16
    lin = (activations(3, 32, dt, 0),) + fp8_weight(16, 32, (16, 16))
    ex = experts_case(3, 2, 4, 32, 16, (16, 16), dt, 0.0)

    def taken(block=(16, 16)) -> list[str]:
        calls.clear()
        if block != (16, 16):
            dispatch.fp8_block_linear(lin[0], lin[1], fp8_block_ops.quantize(lin[1].float(), block)[1], block)
            return calls[:]
        dispatch.fp8_block_linear(*lin, block)
        dispatch.fp8_block_experts(*ex, block)
        return calls[:]
    set_settings(moe_kernel=True)
    with torch.no_grad():
        assert taken() == ["fp8_block_kernel.linear", "fp8_block_moe.fused_experts"]
        assert taken((16, 8)) == ["fp8_block_ops.linear"]
        assert dispatch.fp8_block_kernels(lin[0], Q) and not dispatch.fp8_block_kernels(lin[0], (128, 120))
        set_settings(moe_kernel=False)
        assert taken() == ["fp8_block_kernel.linear", "fp8_block_ops.experts"]
        set_settings(moe_kernel=True)
        lin = (lin[0].float(),) + lin[1:]
        ex = (ex[0].float(),) + ex[1:]
        assert taken() == ["fp8_block_ops.linear", "fp8_block_ops.experts"]
    lin = (lin[0].to(dt),) + lin[1:]
    ex = (ex[0].to(dt),) + ex[1:]
    assert torch.is_grad_enabled() and taken() == ["fp8_block_ops.linear", "fp8_block_ops.experts"]


# -- compiled for Hopper --------------------------------------------------------------------------


def test_kernels_compile_for_hopper():
    """Every block class of both kernels compiles for sm_90 at DeepSeek's shapes, within its
    shared memory and without spills (`tests/compile_fp8_blocks.py`: the GPU compiler on the CPU,
    in a process of its own, as this one's Triton runs interpreted)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "tests.compile_fp8_blocks"], cwd=Path(__file__).parent.parent,
                         env=env, capture_output=True, text=True, timeout=600)
    if run.returncode == 3:
        pytest.skip(run.stdout.strip())
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("ok ") == len(list(compile_fp8_blocks.variants()))
