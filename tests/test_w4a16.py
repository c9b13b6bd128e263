"""The W4A16 kernels (`kernels/int4_kernel.py`: a linear; `kernels/int4_moe_kernel.py`: routed
experts) against the torch forms of `kernels/int4_ops.py` they stand in for, and `dispatch`'s
choice between them. Without CUDA the kernels run under Triton's interpreter at tiny shapes, in
fp32 and fp16 (its dots have no bf16); the GPU cases run bf16 at Kimi K2's shapes. Every output
buffer the kernels allocate starts as NaN (`poisoned`), so an element no program writes shows."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from drafttree.kernels import dispatch, int4_kernel, int4_moe_kernel, int4_ops, moe_align
from tests.helpers import DEVICE, TRITON_REASON, interpreted_on_cpu

pytest.importorskip("triton", reason=TRITON_REASON)


@pytest.fixture(autouse=True)
def _kernel_device(monkeypatch: pytest.MonkeyPatch) -> None:
    interpreted_on_cpu(monkeypatch)


@contextlib.contextmanager
def poisoned() -> Iterator[None]:
    """torch.empty fills what it allocates: NaN for floats, 2^30 for integers (an expert id or
    pair index past every real one)."""
    real = torch.empty

    def empty(*args, **kw):
        t = real(*args, **kw)
        return t.fill_(float("nan") if t.is_floating_point() else 1 << 30)
    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = real


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def int4_weight(rows: tuple[int, ...], K: int, G: int, seed: int, scale_dtype=torch.bfloat16,
                device: str = DEVICE) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed words (every nibble uniform in [-8, 7]) and group scales about 1 / (4 sqrt(K)):
    the layout `int4_ops.quantize` writes, without a dense weight to quantize."""
    g = gen(seed)
    packed = torch.randint(-2 ** 31, 2 ** 31, (*rows, K // int4_ops.PACK), generator=g, dtype=torch.int64)
    scale = (torch.rand(*rows, K // G, generator=g) + 0.5) / (4 * K ** 0.5)
    return packed.to(torch.int32).to(device), scale.to(scale_dtype).to(device)


def close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """The largest difference within tol of the largest value: outputs rounded to 16 bits after
    fp32 sums in another order differ by an ulp of each element, and an element whose sum nearly
    cancels can differ by more than `tol` of itself."""
    assert got.shape == want.shape and got.dtype == want.dtype
    assert not got.isnan().any(), "an output no program wrote"
    err = (got.float() - want.float()).abs().max()
    assert err <= tol * want.float().abs().max(), f"{err:.3e} against {want.float().abs().max():.3e}"


TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


# -- the linear -------------------------------------------------------------------------------------

SMALL = int4_kernel.Blocks(16, 16, 16, 4, 2)   # several programs and steps at tiny shapes
LINEAR = [pytest.param(1, 40, 256, 32, None, True, id="gemv"),
          pytest.param(1, 40, 256, 128, int4_kernel.GemvBlocks(16, 16, 4, 2), False, id="gemv-steps-g128"),
          pytest.param(1, 24, 256, 32, SMALL, True, id="one-row-tiles"),
          pytest.param(5, 40, 384, 32, SMALL, True, id="5rows"),
          pytest.param(20, 48, 256, 128, None, False, id="20rows-g128"),
          pytest.param(40, 24, 128, 8, SMALL, True, id="40rows-g8")]


@pytest.mark.parametrize("dtype,scale_dtype", [(torch.float32, torch.bfloat16), (torch.float16, torch.float16),
                                               (torch.float16, torch.bfloat16)], ids=["fp32", "fp16", "fp16-bf16scale"])
@pytest.mark.parametrize("M,N,K,G,blocks,bias", LINEAR)
def test_linear_matches_the_torch_form(M, N, K, G, blocks, bias, dtype, scale_dtype):
    """Unpacked in registers, the planes' dots give `int4_ops.linear` (the weight unpacked, then
    the matmul) within the dtype's rounding; the tiles round the weight as it does (bf16 scales on
    fp16 inputs: an fp32 product, rounded), the GEMV keeps it unrounded."""
    packed, scale = int4_weight((N,), K, G, seed=M + K, scale_dtype=scale_dtype)
    g = gen(M)
    x = torch.randn(M, K, generator=g).to(dtype).to(DEVICE)
    b = torch.randn(N, generator=g).to(dtype).to(DEVICE) if bias else None
    with poisoned():
        got = int4_kernel.linear(x, packed, scale, G, b, blocks=blocks)
    close(got, int4_ops.linear(x, packed, scale, G, b), TOL[dtype])
    close(got.float(), int4_ops.linear(x.float(), packed, scale, G, None if b is None else b.float()), 2 * TOL[dtype])


def test_linear_keeps_leading_dims():
    packed, scale = int4_weight((24,), 128, 32, seed=0)
    x = torch.randn(2, 3, 128, generator=gen(0)).to(DEVICE)
    got = int4_kernel.linear(x, packed, scale, 32)
    assert got.shape == (2, 3, 24)
    close(got, int4_ops.linear(x, packed, scale, 32), TOL[torch.float32])


@pytest.mark.parametrize("G,K", [(4, 128), (48, 192), (32, 80), (0, 128)])
def test_group_sizes_the_kernels_cannot_take_are_refused(G, K):
    """Groups that split a packed word, are no power of two, or do not divide K: a ValueError
    naming what is supported, from the kernels and from dispatch on every path."""
    packed = torch.zeros(16, K // 8, dtype=torch.int32, device=DEVICE)
    scale = torch.ones(16, max(1, K // max(G, 1)), device=DEVICE)
    x = torch.zeros(2, K, device=DEVICE)
    for call in (lambda: int4_kernel.linear(x, packed, scale, G), lambda: dispatch.int4_linear(x, packed, scale, G)):
        with pytest.raises(ValueError, match="group size|groups of"):
            call()
    gate_up = torch.zeros(3, 32, K // 8, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="group size|groups of"):
        dispatch.int4_experts(x, torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.long), gate_up, scale, gate_up,
                              scale, G)


# -- the grouped experts ----------------------------------------------------------------------------


def experts_case(N: int, k: int, E: int, D: int, I: int, G: int, dtype: torch.dtype, seed: int,
                 dropped: bool = False, scale_dtype=torch.bfloat16, device: str = DEVICE):
    """x [N, D], combine weights and ids [N, k] (k distinct experts a token; `dropped`: about half
    the pairs on id E, another rank's expert), int4 gate_up and down."""
    gate_up, gate_up_scale = int4_weight((E, 2 * I), D, G, seed, scale_dtype, device)
    down, down_scale = int4_weight((E, D), I, G, seed + 1, scale_dtype, device)
    g = gen(seed + 2)
    x = torch.randn(N, D, generator=g).to(dtype).to(device)
    w = torch.rand(N, k, generator=g).to(device)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    if dropped:
        idx = torch.where(torch.rand(N, k, generator=g) < 0.5, idx, E)
    return x, w, idx.to(device), gate_up, gate_up_scale, down, down_scale


SMALL_MOE = int4_moe_kernel.Blocks(16, 16, 16, 16, 4, 2)
EXPERTS = [pytest.param(1, 4, 6, 64, 32, 32, None, False, id="decode-gemv"),
           pytest.param(1, 8, 9, 256, 128, 128, int4_kernel.GemvBlocks(16, 16, 4, 2), True, id="gemv-steps-g128-dropped"),
           pytest.param(1, 3, 5, 96, 48, 8, int4_kernel.GemvBlocks(32, 8, 2, 2), False, id="gemv-edges-g8"),
           pytest.param(1, 4, 6, 64, 32, 32, SMALL_MOE, True, id="one-token-tiles-dropped"),
           pytest.param(6, 2, 7, 128, 64, 32, SMALL_MOE, True, id="6rows-dropped-small-blocks"),
           pytest.param(9, 3, 5, 128, 128, 128, int4_moe_kernel.Blocks(32, 16, 32, 16, 4, 2), False, id="bm32-g128"),
           pytest.param(12, 2, 3, 64, 32, 8, int4_moe_kernel.Blocks(64, 16, 16, 16, 4, 2), True, id="bm64-g8-dropped"),
           pytest.param(20, 1, 2, 64, 32, 32, int4_moe_kernel.Blocks(128, 16, 32, 16, 4, 2), False, id="bm128-top1")]


@pytest.mark.parametrize("dtype,scale_dtype", [(torch.float32, torch.bfloat16), (torch.float16, torch.float16)],
                         ids=["fp32", "fp16"])
@pytest.mark.parametrize("N,k,E,D,I,G,blocks,dropped", EXPERTS)
def test_grouped_experts_match_the_torch_form(N, k, E, D, I, G, blocks, dropped, dtype, scale_dtype):
    """The two grouped GEMMs (one token: the two GEMVs) give `int4_ops.experts` (each pair's expert
    unpacked, rounded at the same points; the GEMVs keep the weight unrounded, as the linear's);
    pairs of id E add nothing and take no slot."""
    x, w, idx, gu, gus, dn, dns = experts_case(N, k, E, D, I, G, dtype, seed=N * 7 + E, dropped=dropped,
                                               scale_dtype=scale_dtype)
    with poisoned():
        got = int4_moe_kernel.fused_experts(x, w, idx, gu, gus, dn, dns, G, blocks, dropless=not dropped)
    close(got, int4_ops.experts(x, w, idx, gu, gus, dn, dns, G), TOL[dtype])


def test_the_torch_forms_agree():
    """`experts_all` (every expert unpacked once, over every row) and `experts` (each pair's)."""
    x, w, idx, gu, gus, dn, dns = experts_case(7, 3, 5, 64, 32, 32, torch.float32, seed=3, dropped=True)
    close(int4_ops.experts_all(x, w, idx, gu, gus, dn, dns, 32), int4_ops.experts(x, w, idx, gu, gus, dn, dns, 32),
          TOL[torch.float32])


def test_grouped_experts_read_nothing_back(monkeypatch):
    """The whole kernel path (layout and both GEMMs) with the read-back calls made to fail."""
    case = experts_case(5, 2, 4, 64, 32, 32, torch.float16, seed=5)
    want = int4_moe_kernel.fused_experts(*case, 32)

    def refuse(*args, **kw):
        raise AssertionError("read back to the host")
    for name in ("item", "tolist", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    monkeypatch.setattr(torch, "nonzero", refuse)
    assert torch.equal(int4_moe_kernel.fused_experts(*case, 32), want)


# -- dispatch ---------------------------------------------------------------------------------------


def test_dispatch_takes_the_kernels_where_they_run(set_settings, monkeypatch):
    """16-bit without autograd: the kernels (the linear where the tiles may run, the experts where
    the grouped GEMMs may); fp32, autograd or the setting off: the torch forms."""
    calls: list[str] = []
    for mod, name in ((int4_kernel, "linear"), (int4_ops, "linear"), (int4_moe_kernel, "fused_experts"),
                      (int4_ops, "experts")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _r=real, _n=f"{mod.__name__.split('.')[-1]}.{name}", **kw:
                            calls.append(_n) or _r(*a, **kw))
    packed, scale = int4_weight((16,), 64, 32, seed=1)
    case = experts_case(2, 2, 3, 64, 32, 32, torch.float16, seed=1)
    x16 = case[0]

    def route(x: torch.Tensor) -> list[str]:
        calls.clear()
        dispatch.int4_linear(x, packed, scale, 32)
        dispatch.int4_experts(x, *case[1:], 32)
        return calls[:]
    set_settings(gemm=True, moe_kernel=True)
    with torch.no_grad():
        assert route(x16) == ["int4_kernel.linear", "int4_moe_kernel.fused_experts"]
        assert route(x16.float()) == ["int4_ops.linear", "int4_ops.experts"]
        set_settings(gemm=False, moe_kernel=False)
        assert route(x16) == ["int4_ops.linear", "int4_ops.experts"]
    set_settings(gemm=True, moe_kernel=True)
    assert torch.is_grad_enabled() and route(x16) == ["int4_ops.linear", "int4_ops.experts"]


def test_deterministic_mode_sums_a_row_alike_at_any_row_count(set_settings):
    """Deterministic mode: fixed tiles at every row count, never the GEMV, so a row alone (a
    decode) gets the bits it gets among others (a verify, a prefill chunk)."""
    set_settings(deterministic=True)
    packed, scale = int4_weight((40,), 256, 32, seed=9)
    x = torch.randn(21, 256, generator=gen(9)).to(torch.float16).to(DEVICE)
    with torch.no_grad():
        whole = dispatch.int4_linear(x, packed, scale, 32)
        for r in (0, 7, 20):
            assert torch.equal(dispatch.int4_linear(x[r:r + 1], packed, scale, 32)[0], whole[r]), r


def test_kernels_compile_for_hopper():
    """The kernels compiled for sm_90 without a GPU (`tests/compile_w4a16.py`, a process of its
    own: this one's Triton runs interpreted): what the interpreter accepts but the GPU compiler
    would reject fails here."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "tests.compile_w4a16"], cwd=Path(__file__).parent.parent, env=env,
                         capture_output=True, text=True, timeout=600)
    if run.returncode == 3:
        pytest.skip(run.stdout.strip())
    assert run.returncode == 0, run.stdout + run.stderr
    from tests import compile_w4a16
    assert run.stdout.count("ok ") == len(list(compile_w4a16.variants()))


# -- on the GPU, at Kimi K2's shapes ---------------------------------------------------------------

# Kimi K2: hidden 7168, expert intermediate 2048, top-8 of 384 routed experts; one rank of eight
# holds 48 of them, so most of a token's picks are another rank's (id E here). Group size 32.
KIMI_D, KIMI_I, KIMI_E, KIMI_ROUTED, KIMI_K, KIMI_G = 7168, 2048, 48, 384, 8, 32
ROWS = [1, 8, 33, 528, 2048]


@pytest.mark.gpu
@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("N,K", [(18432, 7168), (7168, 18432)], ids=["up", "down"])
def test_linear_at_kimi_shapes(N, K, M):
    packed, scale = int4_weight((N,), K, KIMI_G, seed=N + M, device="cuda")
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, device="cuda", dtype=torch.bfloat16) if M == 33 else None
    with poisoned():
        got = int4_kernel.linear(x, packed, scale, KIMI_G, b)
    close(got, int4_ops.linear(x, packed, scale, KIMI_G, b), TOL[torch.bfloat16])
    with torch.no_grad():
        assert torch.equal(dispatch.int4_linear(x, packed, scale, KIMI_G, b), got)
    if M == 1:   # the tiles at one row, which the GEMV replaces
        close(int4_kernel.linear(x, packed, scale, KIMI_G, b, blocks=int4_kernel.blocks_for(1)), got,
              TOL[torch.bfloat16])


@pytest.fixture(scope="module")
def kimi_experts():
    """One rank's 48 int4 Kimi K2 experts (1.2 GB packed), made once."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA")
    gu, gus = int4_weight((KIMI_E, 2 * KIMI_I), KIMI_D, KIMI_G, seed=1, device="cuda")
    dn, dns = int4_weight((KIMI_E, KIMI_D), KIMI_I, KIMI_G, seed=2, device="cuda")
    return gu, gus, dn, dns


def kimi_routing(M: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-8 of 384 per token, as this rank sees it: ids past its 48 experts become E."""
    g = gen(seed)
    routed = torch.stack([torch.randperm(KIMI_ROUTED, generator=g)[:KIMI_K] for _ in range(M)])
    w = torch.rand(M, KIMI_K, generator=g)
    idx = torch.where(routed < KIMI_E, routed, KIMI_E)
    return (w / w.sum(1, keepdim=True)).cuda(), idx.cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("M", ROWS + [8192])   # 8192 rows: 128 slots a tile
def test_grouped_experts_at_kimi_shapes(kimi_experts, M):
    gu, gus, dn, dns = kimi_experts
    w, idx = kimi_routing(M, seed=M)
    x = torch.randn(M, KIMI_D, device="cuda", dtype=torch.bfloat16)
    with poisoned():
        got = int4_moe_kernel.fused_experts(x, w, idx, gu, gus, dn, dns, KIMI_G, dropless=False)
    want = int4_ops.experts_all(x, w, idx, gu, gus, dn, dns, KIMI_G)
    close(got, want, TOL[torch.bfloat16])
    if M <= 8:   # each pair's expert unpacked: 8 rows make 64 Kimi experts' transients
        close(got, int4_ops.experts(x, w, idx, gu, gus, dn, dns, KIMI_G), TOL[torch.bfloat16])
    with torch.no_grad():
        assert torch.equal(dispatch.int4_experts(x, w, idx, gu, gus, dn, dns, KIMI_G, dropless=False), got)


@pytest.mark.gpu
def test_grouped_experts_replay_in_a_cuda_graph():
    """Captured once, replayed with other inputs and routings (the layout kernel's and the torch
    sort's): the eager result each time, bit for bit."""
    for M in (16, 200):   # 128 pairs: the one-program layout; 1600: the torch form's
        case = experts_case(M, 8, 24, 1024, 256, 32, torch.bfloat16, seed=M, device="cuda")
        x, w, idx, gu, gus, dn, dns = case
        sx, sw, sidx = x.clone(), w.clone(), idx.clone()
        assert (M * 8 <= moe_align.ALIGN_KERNEL_MAX_PAIRS) == (M == 16)
        int4_moe_kernel.fused_experts(sx, sw, sidx, gu, gus, dn, dns, 32)   # compile before the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = int4_moe_kernel.fused_experts(sx, sw, sidx, gu, gus, dn, dns, 32)
        for seed in (1, 2, 3):
            x2, w2, idx2 = experts_case(M, 8, 24, 1024, 256, 32, torch.bfloat16, seed=M + seed, device="cuda")[:3]
            sx.copy_(x2)
            sw.copy_(w2)
            sidx.copy_(idx2 if seed < 3 else torch.zeros_like(idx2) + torch.arange(8, device="cuda"))
            graph.replay()
            want = int4_moe_kernel.fused_experts(sx, sw, sidx, gu, gus, dn, dns, 32)
            assert torch.equal(out, want), (M, seed)
            close(out, int4_ops.experts_all(sx, sw, sidx, gu, gus, dn, dns, 32), TOL[torch.bfloat16])
