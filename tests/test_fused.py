"""The compiled elementwise pieces: past Dynamo's default recompile limit they keep working and
keep matching plain PyTorch (a process with many models once failed there on the GPU)."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from drafttree.kernels import torch_ops
from drafttree.models import layers

needs_cc = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                              reason="compiling on CPU needs a C compiler")


@needs_cc
def test_many_variants_compile_and_match_eager(set_settings):
    torch._dynamo.reset()
    # every tensor rank and dtype is one more compiled variant: 12 here, the old limit was 8
    cases = [(dt, rank) for dt in (torch.float32, torch.bfloat16, torch.float16) for rank in (2, 3, 4, 5)]
    g = torch.Generator().manual_seed(0)
    for dt, rank in cases:
        x = torch.randn(*(2,) * (rank - 1), 64, generator=g).to(dt)
        w = torch.randn(64, generator=g).to(dt)
        eps = 1e-5
        d = torch.randn(x.shape, generator=g).to(dt)
        set_settings(compile="0")
        want = torch_ops.rms_norm(x, w, eps), *torch_ops.add_rms_norm(x, d, w, eps)
        set_settings(compile="cpu")
        got = torch_ops.rms_norm(x, w, eps), *torch_ops.add_rms_norm(x, d, w, eps)
        tol = 1e-5 if dt == torch.float32 else 3e-2
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_attention_equals_sdpa(dtype):
    """The few-row attention path (used on CUDA) against SDPA, with a tree-like mask."""
    g = torch.Generator().manual_seed(1)
    B, Hkv, rows, L, hd = 2, 3, 8, 40, 16
    q, k, v = (torch.randn(B, Hkv, n, hd, generator=g).to(dtype) for n in (rows, L, L))
    mask = torch.rand(B, 1, rows, L, generator=g) < 0.7
    mask[..., 0] = True                                             # every row sees something
    got = torch_ops.small_attention(q, k, v, mask, hd ** -0.5)
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                                            scale=hd ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@needs_cc
def test_qk_pieces_compile_and_match_eager(set_settings):
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, 5, 4, 16, generator=g), torch.randn(2, 5, 2, 16, generator=g)
    qw, kw = torch.randn(16, generator=g), torch.randn(16, generator=g)
    ang = torch.randn(2, 5, 1, 16, generator=g)
    cos, sin = ang.cos(), ang.sin()
    outs = {}
    for mode in ("0", "cpu"):
        set_settings(compile=mode)
        outs[mode] = (*torch_ops.rope_qk(q, k, cos, sin), *torch_ops.norm_rope_qk(q, k, qw, kw, 1e-6, cos, sin))
    want = (torch_ops._rope(q, cos, sin), torch_ops._rope(k, cos, sin),
            torch_ops._rope(torch_ops._rms_norm(q, qw, 1e-6), cos, sin),
            torch_ops._rope(torch_ops._rms_norm(k, kw, 1e-6), cos, sin))
    for got in outs.values():
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@needs_cc
def test_round_metadata_compiles_and_matches_eager(set_settings):
    """The rope tables and the attention mask a round builds, compiled as on CUDA, against eager:
    the mask exactly (a decode, a draft block, a tree, at two KV lengths), the tables to rounding."""
    from drafttree.models.kv_cache import attn_meta
    g = torch.Generator().manual_seed(3)
    rotary = layers.Rotary(layers.ModelConfig(arch="llama", vocab_size=8, hidden_size=64, intermediate_size=64,
                                              num_layers=1, num_heads=2, num_kv_heads=1, head_dim=32))
    pos = torch.tensor([[5, 6, 7], [40, 41, 43]])
    start = torch.tensor([5, 40])
    intras = [torch.ones(2, 1, 1, dtype=torch.bool), torch.ones(2, 4, 4, dtype=torch.bool),
              torch.rand(2, 6, 6, generator=g) < 0.5]
    outs = {}
    for mode in ("0", "cpu"):
        set_settings(compile=mode)
        metas = [attn_meta(start, intra, L) for intra in intras for L in (48, 64)]
        outs[mode] = rotary(pos, torch.bfloat16), rotary(pos, torch.float32), metas
    (cb, sb), (cf, sf), metas = outs["cpu"]
    for a, b in zip((cb, sb, cf, sf), (*outs["0"][0], *outs["0"][1])):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    for got, want in zip(metas, outs["0"][2]):
        for a, b in ((got.mask, want.mask), (got.slots, want.slots), (got.rows, want.rows)):
            assert a.shape == b.shape and torch.equal(a, b)


@needs_cc
def test_acceptance_walk_compiles_and_matches_eager(set_settings):
    """`accept` compiled as on CUDA gives exactly eager's lengths, paths and tokens, on built
    trees (several budgets and depths), arbitrary trees and chains, with picks that follow a path."""
    import random

    from drafttree.spec_decode.tree import accept, build_tree, chain_tree
    from tests.tree_reference import path_picks, random_tree
    rng, gen = random.Random(9), torch.Generator().manual_seed(9)
    cases = []
    for _ in range(12):
        R, L, V, budget = rng.randint(1, 3), rng.randint(1, 5), rng.randint(2, 6), rng.randint(1, 20)
        tree = build_tree(torch.randn(R, L, V, generator=gen), torch.randint(0, V, (R,), generator=gen), budget)
        pick = torch.randint(0, V, tree.tokens.shape, generator=gen)
        path_picks(tree, 0, rng.randrange(tree.tokens.shape[1]), pick)
        cases.append((tree, pick, L))
        tree, depth = random_tree(rng, rng.randint(1, 12), 3)
        cases.append((tree, torch.randint(0, 3, tree.tokens.shape, generator=gen), depth + rng.randint(0, 1)))
        chain = chain_tree(torch.randint(0, 3, (R, L), generator=gen), torch.randint(0, 3, (R,), generator=gen))
        cases.append((chain, torch.randint(0, 3, (R, L + 1), generator=gen), None))
    outs = {}
    for mode in ("0", "cpu"):
        set_settings(compile=mode)
        outs[mode] = [accept(tree, pick, L) for tree, pick, L in cases]
    for got, want in zip(outs["cpu"], outs["0"]):
        for a, b in ((got.accept_len, want.accept_len), (got.path, want.path), (got.tokens, want.tokens)):
            assert a.shape == b.shape and torch.equal(a, b)
    assert max(int(a.accept_len.max()) for a in outs["0"]) > 1   # some walks went past the root


@needs_cc
def test_draft_inputs_compile_and_match_eager(set_settings):
    """The drafter's pending context and block inputs, compiled as on CUDA, equal eager's exactly."""
    from drafttree.spec_decode import rounds
    g = torch.Generator().manual_seed(4)
    start, n = torch.tensor([9, 30, 17]), torch.tensor([1, 4, 2])
    feat = torch.randn(3, 5, 6, generator=g).to(torch.bfloat16)
    bonus = torch.tensor([7, 2, 5])
    outs = {}
    for mode in ("0", "cpu"):
        set_settings(compile=mode)
        ctx_feat, ctx_pos = rounds._pending(start, n, feat)
        outs[mode] = (ctx_feat, ctx_pos, *rounds._block(start, bonus, ctx_pos, 4, 99),
                      *rounds._block(start[:1], bonus[:1], ctx_pos[:1], 16, 99))
    for a, b in zip(outs["cpu"], outs["0"]):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    ids, pos, slots, full = outs["0"][2:6]
    assert ids.tolist() == [[7, 99, 99, 99], [2, 99, 99, 99], [5, 99, 99, 99]] and full.all()
    assert pos[1].tolist() == [30, 31, 32, 33] and slots[1].tolist() == [26, 27, 28, 29, 29, 30, 31, 32, 33]


def test_pending_append_compiles_and_matches_eager(set_settings):
    """A decode step's feature append, compiled as on CUDA, writes in place what eager writes, into
    the rows given (a slice of the buffer) and nowhere else; a full row overwrites its last entry."""
    from drafttree.spec_decode import rounds
    g = torch.Generator().manual_seed(5)
    feat0 = torch.randn(4, 5, 6, generator=g).to(torch.bfloat16)
    new = torch.randn(3, 6, generator=g)
    outs = {}
    for mode in ("0", "cpu"):
        set_settings(compile=mode)
        n, feat = torch.tensor([1, 4, 5, 2]), feat0.clone()
        rounds._append_pending(n[:3], feat[:3], new)
        outs[mode] = (n, feat)
    assert torch.equal(outs["cpu"][0], outs["0"][0]) and torch.equal(outs["cpu"][1], outs["0"][1])
    n, feat = outs["0"]
    assert n.tolist() == [2, 5, 5, 2] and torch.equal(feat[3], feat0[3])
    for b, at in enumerate((1, 4, 4)):
        assert torch.equal(feat[b, at], new[b].to(torch.bfloat16))
        assert torch.equal(feat[b, :at], feat0[b, :at])


def test_context_keep_last_and_sampled_log_probs_compile_and_match_eager(set_settings):
    """The context phase's move of the last pending feature to the front, in place, and the
    sampler's log-probabilities of tree nodes (at a temperature, over a filter's threshold),
    compiled as on CUDA, give what eager gives."""
    from drafttree.spec_decode import acceptance, rounds
    g = torch.Generator().manual_seed(6)
    feat0 = torch.randn(4, 5, 6, generator=g)
    logits = torch.randn(3, 4, 7, generator=g) * 2
    temp, thr = torch.tensor([0.7, 1.0, 0.0]), torch.full((3, 4), -0.5)
    parent, tok = torch.tensor([[0, 0, 1]] * 3), torch.randint(0, 7, (3, 3), generator=g)
    outs = {}
    for mode in ("0", "cpu"):
        set_settings(compile=mode)
        n, feat = torch.tensor([1, 4, 5, 2]), feat0.clone()
        rounds._keep_last(n[:3], feat[:3])
        outs[mode] = (n, feat, acceptance._sampled_log_probs(logits, temp, parent, tok, thr),
                      acceptance._sampled_log_probs(logits, temp, parent, tok, None))
    for a, b in zip(outs["cpu"], outs["0"]):
        torch.testing.assert_close(a, b)
    n, feat = outs["0"][:2]
    assert n.tolist() == [1, 1, 1, 2] and torch.equal(feat[3], feat0[3])
    assert [torch.equal(feat[b, 0], feat0[b, at]) for b, at in enumerate((0, 3, 4))] == [True] * 3
    want = torch.log_softmax(logits[1, 0], -1)[tok[1, 0]]   # T = 1, nothing filtered: the softmax itself
    assert outs["0"][3][1, 0].item() == pytest.approx(want.item(), abs=1e-6)


def test_a_piece_whose_compiler_fails_runs_as_torch_ops(monkeypatch, set_settings, caplog):
    """A compiler failure (here a stand-in for one) warns once and leaves the piece to the torch
    ops, with their results; an error of the inputs still raises."""
    from drafttree.kernels import fused as fused_mod
    calls = []

    def broken(fn):
        def run(*args, **kwargs):
            calls.append(fn.__name__)
            raise RuntimeError("backend compiler failed\ndetails")
        return run
    monkeypatch.setattr(fused_mod, "_compile", broken)
    set_settings(compile="cpu")
    piece = fused_mod.fused(lambda x, y: x * 2 + y)
    x = torch.arange(4.0)
    with caplog.at_level("WARNING", logger="drafttree.kernels.fused"):
        assert torch.equal(piece(x, 1.0), x * 2 + 1) and torch.equal(piece(x, 3.0), x * 2 + 3)
    assert len(calls) == 1 and "backend compiler failed" in caplog.text and "details" not in caplog.text
    with pytest.raises(RuntimeError):
        piece(x, torch.ones(3))   # shapes that do not broadcast: the torch ops' own error


@needs_cc
def test_sampler_compiles_and_matches_eager(set_settings):
    """`sample_rows` (compiled on CUDA) picks what its torch ops pick: rows at temperature 0
    and sampled rows, one node and several, unfiltered and after a top-p filter."""
    from drafttree.sampling import SampleMode, SamplingTensors, pick_tokens
    g = torch.Generator().manual_seed(3)
    for R, N in ((1, 1), (3, 4)):
        logits = torch.randn(R, N, 300, generator=g) * 3
        st = SamplingTensors.empty(R, "cpu")
        st.temperature.copy_(torch.tensor([0.7, 0.0, 1.3][:R]))
        st.top_p.fill_(0.9)
        st.seed.copy_(torch.arange(R) + 11)
        pos = torch.arange(N)[None, :] + 40 + torch.arange(R)[:, None]
        for mode in (SampleMode.SAMPLE, SampleMode.FILTERED):
            set_settings(compile="0")
            want = pick_tokens(logits, st, pos, mode)
            set_settings(compile="cpu")
            got = pick_tokens(logits, st, pos, mode)
            assert torch.equal(got, want), (R, N, mode)
        if R > 1:
            assert torch.equal(want[1], logits[1].argmax(-1))           # the greedy row
            assert not torch.equal(want[0], logits[0].argmax(-1))       # the sampled row samples


def test_uncompiled_sampler_takes_a_bounded_number_of_logits_at_a_time(monkeypatch):
    """Uncompiled (a server's start runs the pieces as torch ops), `sample_rows` hashes at most
    EAGER_SAMPLE_LOGITS logits at once: a verify graph at batch 256 once asked for 3 GiB for one of
    its int64 temporaries and ran out of memory. The picks equal those of the whole batch at once."""
    from drafttree import sampling
    g = torch.Generator().manual_seed(4)
    R, N, V = 7, 3, 50
    logits = torch.randn(R, N, V, generator=g) * 2
    temp = torch.tensor([0.0, 0.8, 1.0, 1.5, 0.0, 0.3, 1.0])
    seed = torch.arange(R) + 5
    pos = torch.arange(N)[None, :] + 9 + torch.arange(R)[:, None]
    thr = logits.topk(20, dim=-1).values[..., -1]
    want = [sampling._sample_rows(logits, temp, seed, pos, t) for t in (None, thr)]
    sizes = []
    noise = sampling.gumbel_noise
    monkeypatch.setattr(sampling, "gumbel_noise", lambda s, p, v: sizes.append(p.numel() * v) or noise(s, p, v))
    monkeypatch.setattr(sampling, "EAGER_SAMPLE_LOGITS", 2 * N * V)
    got = [sampling.sample_rows(logits, temp, seed, pos, t) for t in (None, thr)]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert len(sizes) == 8 and max(sizes) <= 2 * N * V   # 4 chunks of at most 2 rows, twice


def test_compiled_pieces_are_cached_with_the_converted_models(set_settings, monkeypatch, tmp_path):
    """Inductor's cache, and Triton's beside it, go under settings.cache in this platform's
    directory unless TORCHINDUCTOR_CACHE_DIR (TRITON_CACHE_DIR) names one, and are set before the
    first piece compiles."""
    from drafttree.kernels import compile_cache, fused as fused_mod
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    set_settings(cache=tmp_path)
    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(os.environ.get("TORCHINDUCTOR_CACHE_DIR")) or fn)
    fused_mod._compile(lambda x: x)
    base = compile_cache.compiled_dir()
    assert base.parent == tmp_path / "compiled" and (base / "platform.json").is_file()
    assert seen == [str(base / "inductor")] and os.environ["TRITON_CACHE_DIR"] == str(base / "triton")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert fused_mod.persist_compile_cache() == str(tmp_path / "mine")


@needs_cc
@pytest.mark.parametrize("groups", [(1, 1), (4, 2)], ids=["one-group", "grouped"])
def test_routing_pieces_compile_and_match_eager(set_settings, groups):
    """DeepSeek-V3's sigmoid routing and a rank's pair renumbering, compiled, against eager: the
    same experts, the same weights."""
    from drafttree.kernels.torch_ops import local_pairs, sigmoid_route
    n_group, topk_group = groups
    g = torch.Generator().manual_seed(4)
    for rows in (1, 5, 33):
        logits, bias = torch.randn(rows, 32, generator=g), torch.randn(32, generator=g) * 0.1
        outs = {}
        for mode in ("0", "cpu"):
            set_settings(compile=mode)
            w, idx = sigmoid_route(logits, bias, 4, n_group, topk_group, True, 2.5)
            outs[mode] = (w, idx, *local_pairs(w, idx, 8, 8))
        (w0, i0, lw0, li0), (w1, i1, lw1, li1) = outs["0"], outs["cpu"]
        assert torch.equal(i0, i1) and torch.equal(li0, li1)
        torch.testing.assert_close(w1, w0, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(lw1, lw0, atol=1e-6, rtol=1e-6)
        assert ((li0 == 8) == ((i0 < 8) | (i0 >= 16))).all() and (lw0[li0 == 8] == 0).all()


@needs_cc
def test_dflash2_pieces_compile_and_match_eager(set_settings, caplog):
    """DFlash2's block convolution, selector edges and the selector's chain walk and tree levels:
    compiled, the same values as torch ops (the tokens exactly)."""
    from drafttree.models.dflash2 import block_convolve, selector_edges
    from drafttree.spec_decode.selector import _beam_levels, _chain_walk
    g = torch.Generator().manual_seed(7)
    R, bs, D, G, taps, V, r, K = 3, 8, 32, 4, 2, 50, 6, 5
    x, base, delta = torch.randn(R, bs, D, generator=g), torch.randn(taps, D, generator=g), \
        torch.randn(R, bs, taps, G, generator=g)
    h, unary = torch.randn(R, bs - 1, r, generator=g), torch.randn(R, bs - 1, K, generator=g)
    P, Q = torch.randn(V, r, generator=g), torch.randn(V, r, generator=g)
    cand = torch.randint(0, V, (R, bs - 1, K), generator=g)
    pred = torch.randint(0, V, (R, bs - 1, K), generator=g)
    outs = {}
    for mode in ("0", "cpu"):
        set_settings(compile=mode)
        with caplog.at_level("WARNING", logger="drafttree.kernels.fused"):
            scores = selector_edges(h, unary, P, Q, cand, pred)
            outs[mode] = (block_convolve(x, base, delta, G, taps), scores, *_chain_walk(cand, scores),
                          *_beam_levels(cand, scores, 6))
    assert "compiling" not in caplog.text   # compiled, not fallen back to torch ops
    for a, b in zip(outs["cpu"], outs["0"]):
        if a.dtype.is_floating_point:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        else:
            assert torch.equal(a, b)
