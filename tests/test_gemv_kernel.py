"""The fused projections (one token row: the GEMVs; 2 to gemm_kernel.MAX_ROWS rows: the
tensor-core kernel, its input splits too) against the torch ops they replace, and a decode and a
layer through them. Without CUDA the kernels run under the Triton interpreter on CPU, where bf16
dots are not emulated: the many-row bf16 cases are GPU cases."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from drafttree.kernels import dispatch, gemm_kernel, gemv_kernel, torch_ops
from drafttree.kernels.torch_ops import add_rms_norm, rms_norm, silu_mul
from tests.helpers import DEVICE, TRITON_REASON, gpu, greedy, interpreted_on_cpu, make_prompts

pytest.importorskip("triton", reason=TRITON_REASON)


@pytest.fixture(autouse=True)
def _kernel_device(monkeypatch: pytest.MonkeyPatch) -> None:
    interpreted_on_cpu(monkeypatch)


TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# Token rows: one (the GEMVs); a draft block; a DDTree verify at budget 32 (padded to 64 rows),
# in one pass, in three input splits, in three programs of 16 rows with two splits (the
# tensor-core kernel's blocks; none, one and two input steps loaded before the PDL wait), at the
# code's blocks for these small weights, and as the torch ops (a weight class without blocks). One
# row also with the first steps' weights loaded as one tile.
ONE_PASS, SPLITS, ROW_BLOCKS = (32, 64, 4, 2, 1, 64, 64, 0), (16, 64, 4, 3, 3, 64, 64, 1), (16, 64, 4, 2, 2, 16, 64, 2)
ROWS = [pytest.param(1, None, id="1row"), pytest.param(1, "prefetch", id="1row_prefetch"),
        pytest.param(16, ONE_PASS, id="16rows"),
        pytest.param(33, ONE_PASS, id="33rows"), pytest.param(33, SPLITS, id="33rows_split"),
        pytest.param(33, ROW_BLOCKS, id="33rows_row_blocks"), pytest.param(33, None, id="33rows_code_blocks"),
        pytest.param(33, "torch", id="33rows_torch_ops")]


def _rows_and_dtypes() -> list:
    """ROWS in fp32 and in bf16. bf16 on the tiles (more than one row, not the torch ops) is a GPU
    case: the interpreter does not emulate bf16 dots."""
    cases = []
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        for p in ROWS:
            rows, blocks = p.values
            tiles = rows > 1 and blocks != "torch" and dtype == torch.bfloat16
            cases.append((gpu if tiles else pytest.param)(rows, blocks, dtype, id=f"{p.id}-{name}"))
    return cases


ROWS_AND_DTYPES = _rows_and_dtypes()


def _rows_case(monkeypatch: pytest.MonkeyPatch, rows: int, blocks) -> None:
    if blocks == "prefetch":   # the GEMVs' first four input steps loaded at once, before the wait
        for kind in gemv_kernel.BLOCKS:
            monkeypatch.setitem(gemv_kernel.BLOCKS, kind, [(0, (4, 32, 4, 4))])
        return
    for kind in gemm_kernel.BLOCKS if blocks else ():
        monkeypatch.setitem(gemm_kernel.BLOCKS, kind, [(0, None if blocks == "torch" else blocks)])


@pytest.mark.parametrize("K,N", [(300, 40), (256, 16), (64, 7)])   # ragged K and N blocks too
@pytest.mark.parametrize("with_delta,with_bias", [(True, False), (False, True)])
@pytest.mark.parametrize("rows,blocks,dtype", ROWS_AND_DTYPES)
def test_norm_gemv_matches_the_torch_ops(K, N, dtype, with_delta, with_bias, rows, blocks, monkeypatch):
    _rows_case(monkeypatch, rows, blocks)
    gen = torch.Generator().manual_seed(K + N)
    x, delta = (torch.randn(1, rows, K, generator=gen).to(dtype).to(DEVICE) for _ in range(2))
    g = (1 + torch.rand(K, generator=gen)).to(dtype).to(DEVICE)
    w = (torch.randn(N, K, generator=gen) / K ** 0.5).to(dtype).to(DEVICE)
    b = torch.randn(N, generator=gen).to(dtype).to(DEVICE) if with_bias else None
    if with_delta:
        want_x, h = add_rms_norm(x, delta, g, 1e-6)
    else:
        want_x, h = x, rms_norm(x, g, 1e-6)
    got_x, y = dispatch.norm_gemv(x, delta if with_delta else None, g, 1e-6, w, b)
    assert y.shape == (1, rows, N) and y.dtype == dtype
    if dtype == torch.float32 or DEVICE == "cuda":
        assert torch.equal(got_x, want_x)
    else:   # the interpreter rounds fp32 -> bf16 toward zero: one bf16 step apart at most
        torch.testing.assert_close(got_x, want_x, atol=0, rtol=2 ** -7)
    torch.testing.assert_close(y.float(), F.linear(h, w, b).float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("K,I", [(300, 40), (64, 7)])
@pytest.mark.parametrize("with_delta", [True, False])
@pytest.mark.parametrize("rows,blocks,dtype", ROWS_AND_DTYPES)
def test_norm_glu_gemv_matches_the_torch_ops(K, I, dtype, with_delta, rows, blocks, monkeypatch):
    """The gate/up projection with SiLU·up as its epilogue: against add + norm, the projection
    and silu_mul; and against silu_mul of the plain norm_gemv's output, which rounds at the same
    points (equal but for the dot's order and, interpreted, the truncating bf16 casts)."""
    _rows_case(monkeypatch, rows, blocks)
    gen = torch.Generator().manual_seed(K + I)
    x, delta = (torch.randn(1, rows, K, generator=gen).to(dtype).to(DEVICE) for _ in range(2))
    delta = delta if with_delta else None
    g = (1 + torch.rand(K, generator=gen)).to(dtype).to(DEVICE)
    w = (torch.randn(2 * I, K, generator=gen) / K ** 0.5).to(dtype).to(DEVICE)
    got_x, h = dispatch.norm_glu_gemv(x, delta, g, 1e-6, w)
    hn = add_rms_norm(x, delta, g, 1e-6)[1] if with_delta else rms_norm(x, g, 1e-6)
    assert h.shape == (1, rows, I) and torch.equal(got_x, dispatch.norm_gemv(x, delta, g, 1e-6, w)[0])
    tol = 2 * TOL[dtype]   # two rounded factors (the torch ops also round the normed input)
    torch.testing.assert_close(h.float(), silu_mul(F.linear(hn, w)).float(), atol=tol, rtol=tol)
    gu = dispatch.norm_gemv(x, delta, g, 1e-6, w)[1]
    g_, u = gu.float().chunk(2, dim=-1)   # the unfused kernels' rounding: silu(gate) rounded, times up
    near = 1e-5 if dtype == torch.float32 else 2 ** -6   # bf16: two steps (the interpreter truncates)
    torch.testing.assert_close(h.float(), (F.silu(g_).to(dtype).float() * u).to(dtype).float(), atol=near, rtol=near)


@pytest.mark.parametrize("blocks", [(16, 256, 4, 1), (4, 1024, 8, 2), (4, 64, 4, 8)])   # a step wider than K
@pytest.mark.parametrize("with_bias", [False, True])
def test_plain_gemv_matches_linear(blocks, with_bias, monkeypatch):
    monkeypatch.setitem(gemv_kernel.BLOCKS, "plain", [(0, blocks)])
    gen = torch.Generator().manual_seed(blocks[0])
    x = torch.randn(1, 1, 300, generator=gen).to(DEVICE)
    w = (torch.randn(21, 300, generator=gen) / 300 ** 0.5).to(DEVICE)
    b = torch.randn(21, generator=gen).to(DEVICE) if with_bias else None
    torch.testing.assert_close(dispatch.gemv(x, w, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["norm", "glu"])
@pytest.mark.parametrize("blocks", [ONE_PASS, SPLITS, ROW_BLOCKS])
def test_tiles_without_their_prologue(kind, blocks, monkeypatch):
    """The QKV and gate/up tiles on rows normed by a launch of their own (`gemv_bench.py
    --prenormed`): without g and delta the kernel skips the norm, keeping gate/up's SiLU·up."""
    monkeypatch.setitem(gemm_kernel.BLOCKS, kind, [(0, blocks)])
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(1, 33, 200, generator=gen).to(DEVICE)
    w = (torch.randn(80, 200, generator=gen) / 200 ** 0.5).to(DEVICE)
    xo, y = gemm_kernel.launch(kind, h, None, None, 0.0, w, None)
    want = silu_mul(F.linear(h, w)) if kind == "glu" else F.linear(h, w)
    assert xo is h
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["norm", "glu", "plain"])
@pytest.mark.parametrize("prefetch", [0, 2, 8])   # none, two steps, more than a split has (clamped)
@pytest.mark.parametrize("blocks", [SPLITS, ROW_BLOCKS])
def test_tile_weights_loaded_before_the_wait(kind, prefetch, blocks, monkeypatch):
    """A tile's first input steps as one wider step, its weights loaded before the PDL wait: the
    same sums as the torch ops, with the residual stream and the norm's squares over all steps."""
    monkeypatch.setitem(gemm_kernel.BLOCKS, kind, [(0, blocks[:7] + (prefetch,))])
    gen = torch.Generator().manual_seed(prefetch)
    x, delta = (torch.randn(1, 33, 300, generator=gen).to(DEVICE) for _ in range(2))
    g = (1 + torch.rand(300, generator=gen)).to(DEVICE)
    w = (torch.randn(80, 300, generator=gen) / 300 ** 0.5).to(DEVICE)
    if kind == "plain":
        got_x, y = x, dispatch.gemv(x, w)
        want_x, want = x, F.linear(x, w)
    else:
        got_x, y = (dispatch.norm_glu_gemv if kind == "glu" else dispatch.norm_gemv)(x, delta, g, 1e-6, w)
        want_x, want = torch_ops.projection(kind, x, delta, g, 1e-6, w, None)
    assert torch.equal(got_x, want_x)
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows,tiled", [(33, True), (34, False)])
def test_rows_past_a_class_take_the_torch_ops(rows, tiled, monkeypatch):
    """A class's blocks cover at most their last field's token rows; more rows run the torch ops."""
    monkeypatch.setitem(gemm_kernel.BLOCKS, "plain", [(0, ROW_BLOCKS[:6] + (33, 0))])
    ran = []
    real = torch_ops.projection
    monkeypatch.setattr(torch_ops, "projection", lambda *a: ran.append(a[0]) or real(*a))
    gen = torch.Generator().manual_seed(rows)
    h = torch.randn(1, rows, 200, generator=gen).to(DEVICE)
    w = (torch.randn(80, 200, generator=gen) / 200 ** 0.5).to(DEVICE)
    torch.testing.assert_close(dispatch.gemv(h, w), F.linear(h, w), atol=1e-5, rtol=1e-5)
    assert ran == ([] if tiled else ["plain"])
    if not tiled:   # the tiles themselves refuse rows their blocks do not cover
        with pytest.raises(ValueError, match="no blocks"):
            gemm_kernel.launch("plain", h, None, None, 0.0, w, None)


def test_block_classes(monkeypatch):
    monkeypatch.setitem(gemv_kernel.BLOCKS, "norm", [(1 << 22, (16, 512, 4, 1)), (0, (8, 512, 4, 1))])
    assert gemv_kernel.blocks_for("norm", 1 << 22) == (16, 512, 4, 1)
    assert gemv_kernel.blocks_for("norm", (1 << 22) - 1) == (8, 512, 4, 1)
    gemv_kernel.set_blocks("norm", 100_000_000, (32, 1024, 8, 1), split=True)   # a class from 2^26
    gemv_kernel.set_blocks("norm", 25_000_000, (4, 512, 8, 1), split=True)      # from 2^24
    gemv_kernel.set_blocks("norm", 1000, (2, 256, 4, 1))                         # the smallest class
    assert [least for least, _ in gemv_kernel.BLOCKS["norm"]] == [1 << 26, 1 << 24, 1 << 22, 0]
    assert gemv_kernel.blocks_for("norm", 1 << 26) == (32, 1024, 8, 1)
    assert gemv_kernel.blocks_for("norm", (1 << 26) - 1) == (4, 512, 8, 1)
    assert gemv_kernel.blocks_for("norm", 5_000_000) == (16, 512, 4, 1)
    assert gemv_kernel.blocks_for("norm", 10) == (2, 256, 4, 1)


def test_refuses_too_many_rows_and_an_odd_gate_up():
    x = torch.zeros(gemm_kernel.MAX_ROWS + 1, 1, 64, device=DEVICE)
    g, w = torch.ones(64, device=DEVICE), torch.zeros(8, 64, device=DEVICE)
    for call in (lambda: dispatch.norm_gemv(x, None, g, 1e-6, w), lambda: dispatch.gemv(x, w),
                 lambda: dispatch.norm_glu_gemv(x, None, g, 1e-6, w)):
        with pytest.raises(ValueError, match=f"at most {gemm_kernel.MAX_ROWS} rows"):
            call()
    for rows in (1, 2):   # [gate | up] needs an even row count
        with pytest.raises(ValueError, match="glu gemv"):
            dispatch.norm_glu_gemv(x[:rows], None, g, 1e-6, torch.zeros(7, 64, device=DEVICE))


@torch.no_grad()
def test_projection_kernels_for_few_16_bit_rows(set_settings):
    set_settings(gemv=True, gemm=True)
    one = torch.zeros(1, 1, 64, dtype=torch.bfloat16, device=DEVICE)
    most = torch.zeros(2, gemm_kernel.MAX_ROWS // 2, 64, dtype=torch.bfloat16, device=DEVICE)
    assert dispatch.projection_kernels(one) and dispatch.projection_kernels(most)
    assert not dispatch.projection_kernels(one.float())                 # fp32 keeps cuBLAS: decode == verify
    too_many = torch.zeros(1, gemm_kernel.MAX_ROWS + 1, 64, dtype=torch.bfloat16, device=DEVICE)
    assert not dispatch.projection_kernels(too_many)
    with torch.enable_grad():   # no backward: training keeps the torch ops
        assert not dispatch.projection_kernels(one)
    set_settings(gemm=False)   # DRAFTTREE_GEMM=0: one row only
    assert dispatch.projection_kernels(one) and not dispatch.projection_kernels(most)
    set_settings(gemv=False)
    assert not dispatch.projection_kernels(one)


@pytest.mark.parametrize("shape", ["qwen3", "qwen2", "llama"])   # q/k norm; QKV bias; neither
def test_decode_through_the_kernels(zoo, monkeypatch, shape):
    """Plain greedy decoding with every one-token layer through the fused projections gives the
    torch ops' tokens (fp32 let in here, on tiny models; the engine takes them for 16-bit only)."""
    from drafttree.llm import LLM
    pair = zoo(shape)
    prompts = make_prompts(pair.vocab)[:2]
    want = [pair.plain(p, 4) for p in prompts]   # interpreted launches are slow: 3 decode steps each
    calls = []
    real = dispatch.norm_glu_gemv
    monkeypatch.setattr(dispatch, "projection_kernels", lambda x: x.shape[0] * x.shape[1] == 1)
    monkeypatch.setattr(dispatch, "norm_glu_gemv", lambda *a: calls.append(1) or real(*a))
    llm = LLM(model=str(pair.target), spec="none", device=DEVICE, dtype="float32", max_num_seqs=1,
              max_model_len=128, cuda_graphs=False)
    assert [o.token_ids for o in llm.generate(prompts, greedy(4))] == want
    assert len(calls) >= 2 * 3 * 3   # 3 one-token steps per prompt, 3 layers each


@pytest.mark.parametrize("shape", ["qwen2", "qwen3", "llama"])
@pytest.mark.parametrize("first", [False, True])   # the first layer has no MLP output to add
@pytest.mark.parametrize("rows,blocks", [(1, None), (5, SPLITS), (5, "torch")])
def test_fused_layer_equals_the_layer(zoo, monkeypatch, shape, first, rows, blocks):
    """The layer's fused path against its usual path, with random norm weights and biases
    (the tiny models' norms are ones and their biases small); attention is the same stand-in in
    both, so this checks what goes into and comes out of each fused projection."""
    from drafttree.config import ModelConfig
    from drafttree.models.decoder import DecoderLayer
    from drafttree.models.layers import Attention
    _rows_case(monkeypatch, rows, blocks)
    cfg = ModelConfig.from_dir(zoo(shape).target)
    torch.manual_seed(5)
    layer = DecoderLayer(cfg).to(DEVICE)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(1.0 if p.dim() == 1 else 0.0, 0.3)
    monkeypatch.setattr(Attention, "attend_qkv", lambda self, qkv, *a: qkv[..., : self.h * self.hd])
    x, delta = torch.randn(2, 1, rows, cfg.hidden_size, device=DEVICE)
    delta = None if first else delta
    with torch.no_grad():
        monkeypatch.setattr(dispatch, "projection_kernels", lambda x: False)
        want = layer(x, delta, None, None, None, None)
        monkeypatch.setattr(dispatch, "projection_kernels", lambda x: True)
        got = layer(x, delta, None, None, None, None)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows,blocks", [(1, None), (4, ONE_PASS), (4, "torch")])
def test_fused_draft_layer_equals_the_layer(zoo, monkeypatch, rows, blocks):
    """A drafter layer's block rows through the fused projections (norm in the QKV projection,
    o, gate/up with SiLU·up, down) against its usual path; a stand-in attention passes q and the
    block's own k and v on, so all three halves of the QKV output are checked."""
    from drafttree.config import ModelConfig
    from drafttree.models import dflash
    _rows_case(monkeypatch, rows, blocks)
    cfg = ModelConfig.from_dir(zoo("qwen3").target)
    torch.manual_seed(6)
    layer = dflash.DraftLayer(cfg).to(DEVICE)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(1.0 if p.dim() == 1 else 0.0, 0.3)
    g = cfg.num_heads // cfg.num_kv_heads

    def attention(q, k, v, *_):
        kv = (k[:, -rows:] + 2 * v[:, -rows:]).repeat_interleave(g, dim=2)
        return (q + kv).flatten(2)
    monkeypatch.setattr(dflash, "cached_attention", attention)
    x, ctx = torch.randn(1, rows, cfg.hidden_size, device=DEVICE), torch.randn(1, 3, cfg.hidden_size, device=DEVICE)
    rope = (torch.ones(1, rows, 1, cfg.head_dim, device=DEVICE), torch.zeros(1, rows, 1, cfg.head_dim, device=DEVICE))
    rope_kv = tuple(t.expand(1, rows + 3, 1, cfg.head_dim) for t in (rope[0][:, :1], rope[1][:, :1]))
    with torch.no_grad():
        monkeypatch.setattr(dispatch, "projection_kernels", lambda x: False)
        want = layer(x, ctx, rope, rope_kv, None, None, None)
        monkeypatch.setattr(dispatch, "projection_kernels", lambda x: True)
        got = layer(x, ctx, rope, rope_kv, None, None, None)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_dependent_launch_only_compiled_on_cuda(monkeypatch, set_settings):
    """PDL needs compiled kernels on a Hopper or newer GPU and a Triton that has it: never on CPU,
    under the interpreter, on Ampere, with an older Triton or with `settings.pdl` off."""
    from drafttree.kernels import triton_jit
    assert not triton_jit.pdl_on("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not triton_jit.pdl_on("cuda")
    assert triton_jit.pdl_options("cpu") == {"PDL": 0}
    monkeypatch.delenv("TRITON_INTERPRET")   # a Hopper GPU, as far as pdl_on can tell
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(triton_jit, "_capability", lambda index: (9, 0))
    set_settings(pdl=True)
    assert triton_jit.pdl_options("cuda") == {"PDL": 1, "launch_pdl": True}
    set_settings(pdl=False)   # DRAFTTREE_PDL=0
    assert triton_jit.pdl_options("cuda") == {"PDL": 0}
    set_settings(pdl=True)
    monkeypatch.setattr(triton_jit, "_triton_has_pdl", lambda: False)   # an older Triton
    assert triton_jit.pdl_options("cuda") == {"PDL": 0}
    monkeypatch.setattr(triton_jit, "_triton_has_pdl", lambda: True)
    monkeypatch.setattr(triton_jit, "_capability", lambda index: (8, 0))   # Ampere
    assert not triton_jit.pdl_on("cuda")


def test_blocks_from_a_sweep_file(tmp_path, monkeypatch):
    """DRAFTTREE_BLOCKS: a one-row sweep's blocks go to the GEMVs; a few-row sweep's to the tiles
    where they beat the torch ops, else None; each in a class of its own."""
    from drafttree.kernels import kernel_blocks
    one = {k: list(v) for k, v in gemv_kernel.BLOCKS.items()}
    few = {k: list(v) for k, v in gemm_kernel.BLOCKS.items()}
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps([["norm", 600_000, [8, 256, 4, 1], 3.0, 4.0],
                                ["glu", 1_800_000, [32, 64, 4, 3, 1, 16, 33], 5.0, 6.0],
                                ["plain", 900_000, [32, 64, 4, 3, 1, 16, 33], 7.0, 6.0],
                                ["plain", 300_000, [32, 64, 4, 3, 1, 16, 33, 2], 2.0, 3.0],
                                ["norm", 3_000_000, None]]))
    kernel_blocks.load(str(path), one, few)
    assert gemm_kernel.blocks_for("norm", 600_000, one) == (8, 256, 4, 1)
    assert gemm_kernel.blocks_for("glu", 1_800_000, few) == (32, 64, 4, 3, 1, 16, 33, 0)   # an older sweep's
    assert gemm_kernel.blocks_for("plain", 300_000, few) == (32, 64, 4, 3, 1, 16, 33, 2)
    assert gemm_kernel.blocks_for("glu", (1 << 20) - 1, few) == gemm_kernel.blocks_for("glu", (1 << 20) - 1)
    assert gemm_kernel.blocks_for("plain", 900_000, few) is None   # lost to the torch ops
    assert gemm_kernel.blocks_for("norm", 3_000_000, few) is None
    assert [least for least, _ in few["norm"]][-3:] == [1 << 22, 1 << 21, 0]
    for bad in ('[["qkv", 10, [1, 2, 3, 4]]]', '[["norm", 10, [1, 2, 3, 4, 5, 6]]]', '[["norm", 10, [1, 2, 3, 0]]]',
                '[["norm", 10, [1, 2, 3, 4, 5, 6, 0]]]', "{not json"):
        path.write_text(bad)
        with pytest.raises(ValueError, match="DRAFTTREE_BLOCKS="):
            kernel_blocks.load(str(path), one, few)
    with pytest.raises(ValueError, match="cannot read"):
        kernel_blocks.load(str(tmp_path / "missing.json"), one, few)


def test_sweep_file_from_the_settings(tmp_path, set_settings):
    """`settings.blocks` (DRAFTTREE_BLOCKS): the kernels look their blocks up in the code's tables
    with that file applied, leaving the tables themselves as they are; a bad file is refused,
    naming the variable."""
    from drafttree.settings import Settings
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps([["glu", 1_800_000, None], ["norm", 600_000, [8, 256, 4, 1]]]))
    code_glu, code_norm = gemm_kernel.blocks_for("glu", 1_800_000), gemv_kernel.blocks_for("norm", 600_000)
    assert code_glu is not None and code_norm != (8, 256, 4, 1)
    set_settings(blocks=Settings.from_env({"DRAFTTREE_BLOCKS": str(path)}).blocks)
    assert gemm_kernel.blocks_for("glu", 1_800_000) is None
    assert gemv_kernel.blocks_for("norm", 600_000) == (8, 256, 4, 1)
    assert gemm_kernel.blocks_for("glu", 1_800_000, gemm_kernel.BLOCKS) == code_glu   # the code's table untouched
    set_settings(blocks=None)
    assert gemm_kernel.blocks_for("glu", 1_800_000) == code_glu
    bad = tmp_path / "bad.json"
    bad.write_text("[1]")
    set_settings(blocks=str(bad))
    with pytest.raises(ValueError, match="DRAFTTREE_BLOCKS="):
        gemm_kernel.blocks_for("glu", 10)
    with pytest.raises(ValueError, match="DRAFTTREE_BLOCKS="):
        Settings.from_env({"DRAFTTREE_BLOCKS": str(tmp_path / "missing.json")})
