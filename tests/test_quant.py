"""fp8 weight-only drafter projections (`models/quant.py`, `gemm_kernel`'s W8 tiles).

The quantization itself, the tiles against the torch ops on the widened weights, in each way of
multiplying (fp32 and fp16 under the Triton interpreter on CPU; bf16 too on CUDA), and the engine: with an fp8 drafter, DDTree
and DFlash still emit exactly plain decoding's tokens (CPU, fp32). The sampled distribution with
an fp8 drafter is in test_spec_sampling.py.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from drafttree import LLM, SamplingParams
from drafttree.kernels import dispatch, gemm_kernel
from drafttree.kernels.torch_ops import add_rms_norm, silu_mul
from drafttree.models import quant
from tests.helpers import (DEVICE, check_lossless, gpu, interpreted_on_cpu, make_prompts, requires_triton,
                           taus_of)

DTYPES = [torch.float32, torch.float16, gpu(torch.bfloat16)]   # bf16 dots are not interpreted
# fp32: a row scaled 50x, summed in another order
TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def test_quantize_rows_round_trip():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(37, 300, generator=gen) * torch.logspace(-3, 2, 37)[:, None]
    w[5] = 0.0   # an all-zero row: no division by zero
    q, scale = quant.quantize_rows(w)
    assert q.dtype == quant.FP8 and scale.dtype == torch.float32 and scale.shape == (37,)
    assert torch.isfinite(q.float()).all()
    nonzero = torch.ones(37, dtype=torch.bool)
    nonzero[5] = False
    assert torch.equal(q.float().abs().amax(1)[nonzero], torch.full((36,), quant.E4M3_MAX))   # absmax -> 448
    back = quant.dequantize(q, scale, torch.float32)
    assert torch.equal(back[5], torch.zeros(300))
    # e4m3 keeps 3 mantissa bits: half a step is 2^-4 of a normal value; subnormals (below
    # 2^-6 of the scale) are 2^-9 apart
    err = (back - w).abs()
    assert (err <= w.abs() * 2 ** -4 + scale[:, None] * 2 ** -10).all()
    assert err.max() > 0   # the values did go through e4m3


@pytest.fixture
def _kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    interpreted_on_cpu(monkeypatch)


def _operands(kind: str, rows: int, K: int, N: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x, delta = (torch.randn(1, rows, K, generator=gen).to(dtype).to(DEVICE) for _ in range(2))
    g = (1 + torch.rand(K, generator=gen)).to(dtype).to(DEVICE)
    w = torch.randn(2 * N if kind == "glu" else N, K, generator=gen) / K ** 0.5
    w[0] *= 50   # rows of very different scales
    q, scale = (t.to(DEVICE) for t in quant.quantize_rows(w))
    return x, delta, g, q, scale


@requires_triton
@pytest.mark.usefixtures("_kernels")
@pytest.mark.parametrize("kind", ["norm", "plain", "glu"])
@pytest.mark.parametrize("rows", [1, 16, 33, 100])   # 100: past the 16-bit tiles' MAX_ROWS
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("blocks", [None, (16, 64, 4, 2, 3, 16, 0, 1)], ids=["code", "split3_pre1"])
@pytest.mark.parametrize("dot", list(gemm_kernel.FP8_DOTS))
def test_fp8_tiles_match_the_widened_weights(kind, rows, dtype, blocks, dot, monkeypatch):
    """Every kind, one row (routed from the GEMVs to the tiles), a draft block, a verify, more rows
    than the 16-bit tiles take; the code's blocks and three input splits with a step loaded before
    the wait; each way of multiplying (fp32 inputs widen whatever is asked: f16 dots would miss
    fp32's tolerance). Reference: the weights widened back, in fp32, rounded where the kernel
    rounds (so a 50x row's cancellations compare in 16 bits too)."""
    monkeypatch.setattr(gemm_kernel, "FP8_DOT", dot)
    if blocks is not None:
        monkeypatch.setitem(gemm_kernel.BLOCKS_FP8, kind, [(0, blocks)])
    K, N = 300, 40
    x, delta, g, q, scale = _operands(kind, rows, K, N, dtype, rows + K)
    if kind == "plain":
        y = gemm_kernel.launch("plain", x, None, None, 0.0, q, None, scale)[1] if rows > 64 else \
            dispatch.gemv(x, q, None, scale)
    else:
        args = (x, delta, g, 1e-6, q)
        call = dispatch.norm_glu_gemv if kind == "glu" else dispatch.norm_gemv
        xo, y = (gemm_kernel.launch(kind, *args, None, scale) if rows > 64
                 else call(*args, scale=scale) if kind == "glu" else call(*args, None, scale))
        torch.testing.assert_close(xo, add_rms_norm(x, delta, g, 1e-6)[0], atol=0,
                                   rtol=2 ** -7 if dtype != torch.float32 else 0)
    assert y.shape == (1, rows, N) and y.dtype == dtype
    want = _reference(kind, x, delta, g, q, scale)
    tol = TOL[dtype] * (2 if kind == "glu" else 1)
    torch.testing.assert_close(y.float(), want.float(), atol=tol, rtol=tol)
    if dtype == torch.float32:   # and the plain torch ops on the widened weights
        w = quant.dequantize(q, scale, torch.float32)
        h = x if kind == "plain" else add_rms_norm(x, delta, g, 1e-6)[1]
        plain = silu_mul(F.linear(h, w)) if kind == "glu" else F.linear(h, w)
        torch.testing.assert_close(y, plain, atol=tol, rtol=tol)


def _reference(kind: str, x, delta, g, q, scale) -> torch.Tensor:
    """The fp8 tile's result as it rounds: the residual stream and the normed input (before 1/rms)
    in x's dtype, fp32 sums of e4m3 values, then the row scale, 1/rms, and for gate/up each of
    gate, up, silu and the product rounded (`glu_out`)."""
    dt = x.dtype
    if kind == "plain":
        pre = x.float() @ q.float().T
    else:
        xs = (x.float() + delta.float()).to(dt).float()
        rs = torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + 1e-6)
        pre = ((g.float() * xs).to(dt).float() @ q.float().T) * rs
    pre = pre * scale
    if kind != "glu":
        return pre.to(dt)
    gate, up = (t.to(dt).float() for t in pre.chunk(2, dim=-1))
    return (F.silu(gate).to(dt).float() * up).to(dt)


@requires_triton
@pytest.mark.usefixtures("_kernels")
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_linear_forward(dtype, monkeypatch):
    """Fp8Linear: the tiles where `dispatch.tiles_take` the input (16-bit on a GPU), else the torch ops on
    the widened weights; bias added once either way."""
    gen = torch.Generator().manual_seed(3)
    lin = torch.nn.Linear(96, 24).to(DEVICE)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(24, 96, generator=gen))
    f8 = quant.Fp8Linear.of(lin)
    assert f8.weight.dtype == quant.FP8 and lin.weight.dtype == torch.float32   # the source is untouched
    x = torch.randn(2, 5, 96, generator=gen).to(dtype).to(DEVICE)
    want = F.linear(x.float(), quant.dequantize(f8.weight, f8.scale, torch.float32), lin.bias.float())
    with torch.no_grad():
        torch.testing.assert_close(f8(x).float(), want, atol=TOL[dtype], rtol=TOL[dtype])
        monkeypatch.setattr(dispatch, "tiles_take", lambda x: True)   # the tiles in fp32 too
        torch.testing.assert_close(f8(x).float(), want, atol=TOL[dtype], rtol=TOL[dtype])


def test_check_refuses_unknown_methods_and_old_gpus(monkeypatch):
    with pytest.raises(ValueError, match="unknown draft quantization 'int4'"):
        quant.check("int4", "cpu")
    quant.check("fp8", "cpu")
    monkeypatch.setattr(dispatch, "interpreting", lambda: False)
    monkeypatch.setattr(dispatch, "kernels_run_on", lambda dev: True)
    monkeypatch.setattr(dispatch, "capability", lambda dev: (8, 0))
    with pytest.raises(ValueError, match="compute capability 8.9"):
        quant.check("fp8", "cuda")
    monkeypatch.setattr(dispatch, "capability", lambda dev: (9, 0))
    quant.check("fp8", "cuda")


def test_engine_refuses_an_unknown_quantization_before_loading(zoo, monkeypatch):
    pair = zoo("qwen3")
    import drafttree.loader.weights as weights

    monkeypatch.setattr(weights, "load_target", lambda *a, **k: pytest.fail("weights loaded before the check"))
    with pytest.raises(ValueError, match="unknown draft quantization"):
        LLM(model=str(pair.target), draft_model=str(pair.drafter), spec="ddtree", device="cpu",
            draft_quantization="int3")


@pytest.mark.parametrize("shape,spec,budget", [("llama", "ddtree", 32), ("qwen3", "ddtree", 8),
                                               ("qwen2", "dflash", 1)])
def test_fp8_drafter_is_lossless(zoo, shape, spec, budget):
    """fp32 on CPU: the fp8 drafter's rounds emit plain greedy decoding's tokens; its weights and
    LM head copy are e4m3, the target's LM head is untouched."""
    pair = zoo(shape)
    llm = LLM(model=str(pair.target), draft_model=str(pair.drafter), spec=spec, block_size=4, budget=budget,
              device="cpu", dtype="float32", max_num_seqs=3, max_model_len=128, draft_quantization="fp8")
    runner = llm.engine.runner
    d = runner.drafter
    assert d.fc.weight.dtype == quant.FP8 and d.draft_head.weight.dtype == quant.FP8
    assert all(layer.mlp.down_proj.weight.dtype == quant.FP8 for layer in d.layers)
    assert runner.target.lm_head.weight.dtype == torch.float32 and d.lm_head is runner.target.lm_head
    outs = check_lossless(pair, llm, make_prompts(pair.vocab), max_tau=4)
    assert max(taus_of(outs)) >= 2, "no round accepted a drafted token"


@pytest.mark.gpu
@pytest.mark.parametrize("spec,budget", [("dflash", 1), ("ddtree", 32)])
@pytest.mark.parametrize("batch", [1, 3])
def test_fp8_drafter_graphed_equals_eager(zoo, spec, budget, batch, monkeypatch):
    """bf16 on CUDA: graph replay with the fp8 drafter gives eager's tokens (greedy and sampled), each
    kind of projection (QKV + norm, plain, gate/up) runs as a W8 tile, and no batch falls back."""
    pair = zoo("qwen3", 61)
    scaled, real = [], gemm_kernel.launch

    def counted(*a):
        if len(a) == 8 and a[7] is not None:   # a scale: fp8 weights
            scaled.append(a[0])
        return real(*a)
    monkeypatch.setattr(gemm_kernel, "launch", counted)
    prompts = [list(range(3, 3 + 5 * (i + 1))) for i in range(batch)]
    sp = [SamplingParams(temperature=0.8 * (i % 2), top_p=0.9, max_tokens=40, seed=i, ignore_eos=True)
          for i in range(batch)]
    outs = {}
    for graphs in (False, True):
        llm = LLM(model=str(pair.target), draft_model=str(pair.drafter), spec=spec, block_size=4, budget=budget,
                  device="cuda", dtype="bfloat16", max_num_seqs=4, max_model_len=256, cuda_graphs=graphs,
                  draft_quantization="fp8")
        outs[graphs] = [o.token_ids for o in llm.generate(prompts, sp)]
    assert outs[True] == outs[False] and llm.engine.runner.graphs.fallbacks == 0
    assert {"norm", "plain", "glu"} <= set(scaled)


def test_graph_plan_names_the_quantization(zoo):
    """`drafttree graphs` shows it (the widths do not change) and refuses an unknown one, weight-free."""
    from drafttree.engine.engine import EngineConfig
    from drafttree.engine.plan import describe_plan
    pair = zoo("qwen3")
    cfg = dict(model=str(pair.target), draft_model=str(pair.drafter), spec="ddtree", budget=32)
    text = describe_plan(EngineConfig(**cfg, draft_quantization="fp8"))
    assert "draft_quantization=fp8" in text and "verify=33" in text
    assert "draft_quantization" not in describe_plan(EngineConfig(**cfg))
    with pytest.raises(ValueError, match="unknown draft quantization"):
        describe_plan(EngineConfig(**cfg, draft_quantization="int4"))
