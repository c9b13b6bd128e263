"""The grouped expert GEMMs (`kernels/moe_kernel.py`) and the expert-sorted layout they read
(`kernels/moe_align.py`), against the torch forms of `models.moe.Experts`. Without CUDA the
kernels run under Triton's interpreter, which does not emulate bf16 dots: bf16 is a GPU case,
fp16 stands for the 16-bit models on CPU."""
from __future__ import annotations

import math

import pytest
import torch

from drafttree.kernels import dispatch, moe_align, moe_kernel
from drafttree.models import moe
from drafttree.moe_config import MoEConfig
from tests.helpers import DEVICE, TRITON_REASON, gpu, interpreted_on_cpu

pytest.importorskip("triton", reason=TRITON_REASON)


@pytest.fixture(autouse=True)
def _kernel_device(monkeypatch: pytest.MonkeyPatch) -> None:
    interpreted_on_cpu(monkeypatch)


def routing(kind: str, N: int, k: int, E: int, seed: int = 0) -> torch.Tensor:
    """idx [N, k]: "topk", k distinct experts per token; "one", every token on experts 0..k-1
    (k = 1: every pair on one expert); "few", every pick among experts 1 and E - 1 (repeats too,
    most experts empty); "dropped", "topk" with about half the pairs on id E (another
    tensor-parallel rank's experts: no slot)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "topk":
        idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    elif kind == "one":
        idx = torch.arange(k).expand(N, k)
    elif kind == "few":
        idx = torch.where(torch.rand(N, k, generator=g) < 0.5, 1, E - 1)
    else:
        idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
        idx = torch.where(torch.rand(N, k, generator=g) < 0.5, idx, E)
    return idx.to(DEVICE)


def reference_layout(idx: torch.Tensor, E: int, bm: int) -> tuple[list[int], list[int]]:
    """The layout by its definition: per expert in order, its pairs ascending, padded to whole
    tiles with P; then padding tiles (expert E) up to the static bound."""
    flat = idx.flatten().tolist()
    P = len(flat)
    pairs: list[int] = []
    tiles: list[int] = []
    for e in range(E):
        mine = [p for p in range(P) if flat[p] == e]
        n = math.ceil(len(mine) / bm)
        pairs += mine + [P] * (n * bm - len(mine))
        tiles += [e] * n
    T = moe_align.max_tiles(P, E, bm)
    assert len(tiles) <= T
    return pairs + [P] * (T * bm - len(pairs)), tiles + [E] * (T - len(tiles))


LAYOUTS = [(1, 8, 10, 16, "topk"), (5, 2, 7, 16, "topk"), (40, 8, 10, 16, "topk"), (33, 8, 130, 16, "topk"),
           (40, 1, 5, 16, "one"), (17, 2, 9, 32, "few"), (40, 8, 3, 64, "few"), (3, 1, 6, 16, "topk"),
           (40, 8, 16, 16, "dropped"), (9, 2, 7, 16, "dropped")]


@pytest.mark.parametrize("N,k,E,bm,kind", LAYOUTS)
@pytest.mark.parametrize("form", ["kernel", "kernel_small_blocks", "torch"])
def test_layout_is_the_expert_sorted_padded_order(N, k, E, bm, kind, form, monkeypatch):
    """Both builders give the defined layout exactly; small comparison blocks make the kernel's
    loops over pairs and tiles take several steps."""
    if form == "kernel_small_blocks":
        monkeypatch.setattr(moe_align, "ALIGN_BLOCK", 256)
    idx = routing(kind, N, k, E, seed=N + E)
    build = moe_align.align_torch if form == "torch" else moe_align.align
    lay = build(idx, E, bm)
    pairs, tiles = reference_layout(idx, E, bm)
    assert lay.block_m == bm and lay.pairs.dtype == lay.tile_expert.dtype == torch.int32
    assert lay.pairs.tolist() == pairs
    assert lay.tile_expert.tolist() == tiles


@pytest.mark.parametrize("form", [moe_align.align, moe_align.align_torch])
def test_layout_sizes_depend_on_shapes_only(form):
    """Whatever the routing, the same N, k, E and BM give the same sizes: the bound, with nothing
    read back to size them."""
    for N, k, E, bm in [(1, 8, 128, 16), (16, 8, 128, 16), (33, 2, 7, 32)]:
        T = moe_align.max_tiles(N * k, E, bm)
        for kind in ("topk", "one", "few"):
            lay = form(routing(kind, N, k, E), E, bm)
            assert lay.tile_expert.shape == (T,) and lay.pairs.shape == (T * bm,), (N, k, E, bm, kind)


def test_torch_layout_traces_without_a_host_sync():
    """The torch builder traces into one graph (torch.compile fullgraph): no data-dependent shape,
    no read-back, so it can be captured in a CUDA graph."""
    idx = routing("topk", 9, 2, 7)
    torch._dynamo.reset()
    traced = torch.compile(moe_align.align_torch, backend="eager", fullgraph=True)
    for got, want in zip(traced(idx, 7, 16), moe_align.align_torch(idx, 7, 16)):
        assert got == want if isinstance(want, int) else torch.equal(got, want)


def test_grouped_experts_read_nothing_back(monkeypatch):
    """The whole kernel path (layout and both GEMMs) with the read-back calls made to fail."""
    ex, x, w, idx = experts_case(12, 2, 7, 32, 16, "topk", torch.float16)
    want = moe_kernel.fused_experts(x, w, idx, ex.gate_up, ex.down)

    def refuse(*args, **kw):
        raise AssertionError("read back to the host")
    for name in ("item", "tolist", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    monkeypatch.setattr(torch, "nonzero", refuse)
    assert torch.equal(moe_kernel.fused_experts(x, w, idx, ex.gate_up, ex.down), want)


def experts_case(N: int, k: int, E: int, D: int, I: int, kind: str,
                 dtype: torch.dtype) -> tuple[moe.Experts, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(N * 31 + E)
    cfg = MoEConfig(num_experts=E, top_k=k, intermediate_size=I, scoring="softmax", norm_topk_prob=True,
                    sparse_layers=(0,))
    ex = moe.Experts(D, cfg)
    with torch.no_grad():
        ex.gate_up.copy_(torch.randn(ex.gate_up.shape, generator=g) / D ** 0.5)
        ex.down.copy_(torch.randn(ex.down.shape, generator=g) / I ** 0.5)
    ex = ex.to(device=DEVICE, dtype=dtype).requires_grad_(False)
    x = torch.randn(N, D, generator=g).to(device=DEVICE, dtype=dtype)
    w = torch.rand(N, k, generator=g).to(DEVICE)
    return ex, x, w, routing(kind, N, k, E, seed=N)


SMALL = moe_kernel.Blocks(16, 16, 16, 16, 4, 2)   # several weight-row programs and input steps
CASES = [pytest.param(1, 8, 10, 64, 32, "topk", None, id="decode"),
         pytest.param(2, 8, 10, 48, 40, "topk", SMALL, id="2rows_small_blocks"),
         pytest.param(33, 8, 20, 32, 16, "topk", None, id="verify"),
         pytest.param(40, 2, 7, 40, 24, "topk", SMALL, id="40rows_small_blocks"),
         pytest.param(40, 1, 5, 32, 16, "one", moe_kernel.Blocks(32, 16, 32, 16, 4, 2), id="one_expert_bm32"),
         pytest.param(25, 2, 9, 32, 24, "few", moe_kernel.Blocks(64, 32, 16, 32, 4, 2), id="few_experts_bm64"),
         pytest.param(3, 1, 6, 24, 8, "topk", None, id="top1")]


def _dtypes() -> list:
    return [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
            gpu(torch.bfloat16, id="bf16")]


@pytest.mark.parametrize("dtype", _dtypes())
@pytest.mark.parametrize("N,k,E,D,I,kind,blocks", CASES)
def test_grouped_experts_match_the_torch_forms(N, k, E, D, I, kind, blocks, dtype):
    """The kernels against `Experts.sorted` in the same dtype (the same rounding points: each
    expert's output, the combine weight, the sum over k) and against `all_experts` in fp32."""
    ex, x, w, idx = experts_case(N, k, E, D, I, kind, dtype)
    got = moe_kernel.fused_experts(x, w, idx, ex.gate_up, ex.down, blocks)
    assert got.shape == (N, D) and got.dtype == dtype
    same_dtype = ex.sorted(x, w, idx)
    exact = ex.float().all_experts(x.float(), w, idx)
    if dtype == torch.float32:
        torch.testing.assert_close(got, exact, atol=1e-5, rtol=1e-5)
        return
    tol = {torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    if dtype == torch.bfloat16:
        # the two round h at different points (the torch forms to bf16 after each product): an
        # element whose sum nearly cancels can move by more than 2e-2 of itself, so the bound is
        # on the largest difference against the output's scale
        scale = same_dtype.float().abs().max()
        assert (got.float() - same_dtype.float()).abs().max() <= tol * scale
        assert (got.float() - exact).abs().max() <= tol * exact.abs().max()
        return
    torch.testing.assert_close(got.float(), same_dtype.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got.float(), exact, atol=2 * tol, rtol=2 * tol)


def test_many_pairs_take_the_torch_layout(monkeypatch):
    """Past ALIGN_KERNEL_MAX_PAIRS the layout comes from the torch builder: the same result."""
    ex, x, w, idx = experts_case(20, 2, 7, 32, 16, "topk", torch.float32)
    want = moe_kernel.fused_experts(x, w, idx, ex.gate_up, ex.down)
    calls = []
    torch_layout = moe_align.align_torch
    monkeypatch.setattr(moe_align, "ALIGN_KERNEL_MAX_PAIRS", 39)
    monkeypatch.setattr(moe_align, "align_torch", lambda *a: calls.append(a) or torch_layout(*a))
    assert torch.equal(moe_kernel.fused_experts(x, w, idx, ex.gate_up, ex.down), want) and len(calls) == 1


def test_experts_forward_takes_the_kernels_where_dispatch_says(set_settings):
    """16-bit without autograd takes `Experts.grouped`; fp32, autograd or the setting off keep the
    torch forms."""
    ex, x, w, idx = experts_case(4, 2, 6, 32, 16, "topk", torch.float16)
    set_settings(moe_kernel=True)
    with torch.no_grad():
        assert dispatch.moe_kernels(x)
        torch.testing.assert_close(ex(x, w, idx), ex.grouped(x, w, idx), atol=0, rtol=0)
        assert not dispatch.moe_kernels(x.float())
        set_settings(moe_kernel=False)
        assert not dispatch.moe_kernels(x)
    set_settings(moe_kernel=True)
    assert torch.is_grad_enabled() and not dispatch.moe_kernels(x)


@pytest.mark.gpu
def test_grouped_experts_replay_in_a_cuda_graph():
    """Captured once, replayed with other routings and inputs: the eager result each time."""
    ex, x, w, idx = experts_case(16, 8, 24, 256, 128, "topk", torch.bfloat16)
    sx, sw, sidx = x.clone(), w.clone(), idx.clone()
    moe_kernel.fused_experts(sx, sw, sidx, ex.gate_up, ex.down)   # compile before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_kernel.fused_experts(sx, sw, sidx, ex.gate_up, ex.down)
    for seed, kind in ((1, "topk"), (2, "one"), (3, "few")):
        _, x2, w2, _ = experts_case(16, 8, 24, 256, 128, "topk", torch.bfloat16)
        sx.copy_(x2 * seed)
        sw.copy_(w2)
        sidx.copy_(routing(kind, 16, 8, 24, seed))
        graph.replay()
        assert torch.equal(out, moe_kernel.fused_experts(sx, sw, sidx, ex.gate_up, ex.down)), kind


@pytest.mark.parametrize("N,k,E", [(1, 8, 16), (33, 8, 16), (40, 2, 7)])
def test_pairs_of_another_rank_are_not_computed(N, k, E):
    """Pairs of id E (`Experts.local` on a sharded block) take no slot, and the result is the sum
    over the others alone: the same as weighing them zero on any expert."""
    ex, x, w, _ = experts_case(N, k, E, 32, 16, "topk", torch.float32)
    idx = routing("dropped", N, k, E, seed=N)
    mine = idx < E
    lay = moe_align.layout(idx, E, 16)
    assert sorted(p for p in lay.pairs.tolist() if p < N * k) == [p for p in range(N * k) if mine.flatten()[p]]
    got = moe_kernel.fused_experts(x, w, idx, ex.gate_up, ex.down, dropless=False)
    want = ex.all_experts(x, w * mine, idx.clamp(max=E - 1))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
