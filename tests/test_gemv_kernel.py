"""The one-token projections with fused prologues against the torch ops they replace, and a
decode through them. Without CUDA the kernels run under the Triton interpreter on CPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from drafttree.models import gemv_kernel
from drafttree.models.layers import add_rms_norm, rms_norm, silu_mul
from tests.test_spec_lossless import zoo  # noqa: F401  (fixture)
from tests.test_tree_kernel import DEVICE, interpreted_on_cpu


@pytest.fixture(autouse=True)
def _kernel_device(monkeypatch: pytest.MonkeyPatch) -> None:
    interpreted_on_cpu(monkeypatch)


TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("K,N", [(300, 40), (256, 16), (64, 7)])   # ragged K and N blocks too
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_delta,with_bias", [(True, False), (False, True)])
def test_norm_gemv_matches_the_torch_ops(K, N, dtype, with_delta, with_bias):
    gen = torch.Generator().manual_seed(K + N)
    x, delta = (torch.randn(1, 1, K, generator=gen).to(dtype).to(DEVICE) for _ in range(2))
    g = (1 + torch.rand(K, generator=gen)).to(dtype).to(DEVICE)
    w = (torch.randn(N, K, generator=gen) / K ** 0.5).to(dtype).to(DEVICE)
    b = torch.randn(N, generator=gen).to(dtype).to(DEVICE) if with_bias else None
    if with_delta:
        want_x, h = add_rms_norm(x, delta, g, 1e-6)
    else:
        want_x, h = x, rms_norm(x, g, 1e-6)
    got_x, y = gemv_kernel.norm_gemv(x, delta if with_delta else None, g, 1e-6, w, b)
    assert y.shape == (1, 1, N) and y.dtype == dtype
    if dtype == torch.float32 or DEVICE == "cuda":
        assert torch.equal(got_x, want_x)
    else:   # the interpreter rounds fp32 -> bf16 toward zero: one bf16 step apart at most
        torch.testing.assert_close(got_x, want_x, atol=0, rtol=2 ** -7)
    torch.testing.assert_close(y.float(), F.linear(h, w, b).float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("K,I", [(300, 40), (64, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_delta", [True, False])
def test_norm_glu_gemv_matches_the_torch_ops(K, I, dtype, with_delta):
    """The gate/up projection with SiLU·up as its epilogue: against add + norm, the projection
    and silu_mul; and against silu_mul of the plain norm_gemv's output, which rounds at the same
    points (equal but for the dot's order and, interpreted, the truncating bf16 casts)."""
    gen = torch.Generator().manual_seed(K + I)
    x, delta = (torch.randn(1, 1, K, generator=gen).to(dtype).to(DEVICE) for _ in range(2))
    delta = delta if with_delta else None
    g = (1 + torch.rand(K, generator=gen)).to(dtype).to(DEVICE)
    w = (torch.randn(2 * I, K, generator=gen) / K ** 0.5).to(dtype).to(DEVICE)
    got_x, h = gemv_kernel.norm_glu_gemv(x, delta, g, 1e-6, w)
    hn = add_rms_norm(x, delta, g, 1e-6)[1] if with_delta else rms_norm(x, g, 1e-6)
    assert h.shape == (1, 1, I) and torch.equal(got_x, gemv_kernel.norm_gemv(x, delta, g, 1e-6, w)[0])
    tol = 2 * TOL[dtype]   # two rounded factors (the torch ops also round the normed input)
    torch.testing.assert_close(h.float(), silu_mul(F.linear(hn, w)).float(), atol=tol, rtol=tol)
    gu = gemv_kernel.norm_gemv(x, delta, g, 1e-6, w)[1]
    g_, u = gu.float().chunk(2, dim=-1)   # the unfused kernels' rounding: silu(gate) rounded, times up
    near = 1e-5 if dtype == torch.float32 else 2 ** -6   # bf16: two steps (the interpreter truncates)
    torch.testing.assert_close(h.float(), (F.silu(g_).to(dtype).float() * u).to(dtype).float(), atol=near, rtol=near)


@pytest.mark.parametrize("blocks", [(16, 256, 4), (4, 1024, 8)])   # a step wider than K too
@pytest.mark.parametrize("with_bias", [False, True])
def test_plain_gemv_matches_linear(blocks, with_bias, monkeypatch):
    monkeypatch.setitem(gemv_kernel.BLOCKS, "plain", [(0, blocks)])
    gen = torch.Generator().manual_seed(blocks[0])
    x = torch.randn(1, 1, 300, generator=gen).to(DEVICE)
    w = (torch.randn(21, 300, generator=gen) / 300 ** 0.5).to(DEVICE)
    b = torch.randn(21, generator=gen).to(DEVICE) if with_bias else None
    torch.testing.assert_close(gemv_kernel.gemv(x, w, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_block_classes(monkeypatch):
    monkeypatch.setitem(gemv_kernel.BLOCKS, "norm", [(1 << 22, (16, 512, 4)), (0, (8, 512, 4))])
    assert gemv_kernel.blocks_for("norm", 1 << 22) == (16, 512, 4)
    assert gemv_kernel.blocks_for("norm", (1 << 22) - 1) == (8, 512, 4)
    gemv_kernel.set_blocks("norm", 100_000_000, (32, 1024, 8), split=True)   # a class from 2^26
    gemv_kernel.set_blocks("norm", 25_000_000, (4, 512, 8), split=True)      # from 2^24
    gemv_kernel.set_blocks("norm", 1000, (2, 256, 4))                         # the smallest class
    assert [least for least, _ in gemv_kernel.BLOCKS["norm"]] == [1 << 26, 1 << 24, 1 << 22, 0]
    assert gemv_kernel.blocks_for("norm", 1 << 26) == (32, 1024, 8)
    assert gemv_kernel.blocks_for("norm", (1 << 26) - 1) == (4, 512, 8)
    assert gemv_kernel.blocks_for("norm", 5_000_000) == (16, 512, 4)
    assert gemv_kernel.blocks_for("norm", 10) == (2, 256, 4)


def test_refuses_more_than_one_row_and_an_odd_gate_up():
    x = torch.zeros(2, 1, 64, device=DEVICE)
    with pytest.raises(ValueError, match="one row"):
        gemv_kernel.norm_gemv(x, None, torch.ones(64, device=DEVICE), 1e-6, torch.zeros(8, 64, device=DEVICE))
    with pytest.raises(ValueError, match="one row"):
        gemv_kernel.norm_glu_gemv(x, None, torch.ones(64, device=DEVICE), 1e-6, torch.zeros(8, 64, device=DEVICE))
    with pytest.raises(ValueError, match="one row"):
        gemv_kernel.gemv(x, torch.zeros(8, 64, device=DEVICE))
    with pytest.raises(ValueError, match="glu gemv"):   # [gate | up] needs an even row count
        gemv_kernel.norm_glu_gemv(x[:1], None, torch.ones(64, device=DEVICE), 1e-6, torch.zeros(7, 64, device=DEVICE))


def test_usable_only_for_one_16_bit_token(monkeypatch):
    monkeypatch.setattr(gemv_kernel, "ENABLED", True)
    one = torch.zeros(1, 1, 64, dtype=torch.bfloat16, device=DEVICE)
    assert gemv_kernel.usable(one)
    assert not gemv_kernel.usable(one.float())                 # fp32 keeps cuBLAS: decode == verify
    assert not gemv_kernel.usable(torch.zeros(1, 2, 64, dtype=torch.bfloat16, device=DEVICE))
    monkeypatch.setattr(gemv_kernel, "ENABLED", False)
    assert not gemv_kernel.usable(one)


@pytest.mark.parametrize("shape", ["qwen3", "qwen2", "llama"])   # q/k norm; QKV bias; neither
def test_decode_through_the_kernels(zoo, monkeypatch, shape):
    """Plain greedy decoding with every one-token layer through the fused projections gives the
    torch ops' tokens (fp32 let in here, on tiny models; the engine takes them for 16-bit only)."""
    from drafttree.llm import LLM
    from tests.test_spec_lossless import greedy, make_prompts
    pair = zoo(shape)
    prompts = make_prompts(pair.vocab)[:2]
    want = [pair.plain(p, 8) for p in prompts]
    calls = []
    real = gemv_kernel.norm_glu_gemv
    monkeypatch.setattr(gemv_kernel, "usable", lambda x: x.shape[0] * x.shape[1] == 1)
    monkeypatch.setattr(gemv_kernel, "norm_glu_gemv", lambda *a: calls.append(1) or real(*a))
    llm = LLM(model=str(pair.target), spec="none", device=DEVICE, dtype="float32", max_num_seqs=1,
              max_model_len=128, cuda_graphs=False)
    assert [o.token_ids for o in llm.generate(prompts, greedy(8))] == want
    assert len(calls) >= 7 * 3   # 7 one-token steps per prompt, 3 layers each


@pytest.mark.parametrize("shape", ["qwen2", "qwen3", "llama"])
@pytest.mark.parametrize("first", [False, True])   # the first layer has no MLP output to add
def test_one_token_layer_equals_the_layer(zoo, monkeypatch, shape, first):
    """The layer's one-token path against its usual path, with random norm weights and biases
    (the tiny models' norms are ones and their biases small); attention is the same stand-in in
    both, so this checks what goes into and comes out of each fused projection."""
    from drafttree.config import ModelConfig
    from drafttree.models.decoder import DecoderLayer
    from drafttree.models.layers import Attention
    cfg = ModelConfig.from_dir(zoo(shape).target)
    torch.manual_seed(5)
    layer = DecoderLayer(cfg).to(DEVICE)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(1.0 if p.dim() == 1 else 0.0, 0.3)
    monkeypatch.setattr(Attention, "attend_qkv", lambda self, qkv, *a: qkv[..., : self.h * self.hd])
    x, delta = torch.randn(2, 1, 1, cfg.hidden_size, device=DEVICE)
    delta = None if first else delta
    with torch.no_grad():
        monkeypatch.setattr(gemv_kernel, "usable", lambda x: False)
        want = layer(x, delta, None, None, None, None)
        monkeypatch.setattr(gemv_kernel, "usable", lambda x: True)
        got = layer(x, delta, None, None, None, None)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
