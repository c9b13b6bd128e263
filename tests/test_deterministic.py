"""Deterministic mode: a token's logits (and the features the drafter reads) are the same bits
whether the token is computed in a prefill, a decode, a DFlash chain or DDTree tree verify, or
beside other requests; so speculative decoding gives plain decoding's tokens bit for bit.

On CPU the kernels run under Triton's interpreter, in fp32 and fp16 (its dots have no bf16); the
GPU cases run bf16 on CUDA.
"""
from __future__ import annotations

import pytest
import torch

from drafttree import LLM, SamplingParams
from drafttree.config import ModelConfig
from drafttree.kernels import gemm_kernel, invariant_attn, norm_kernel
from drafttree.loader.weights import load_target
from drafttree.models.kv_cache import KVCache, attn_meta, causal
from tests.helpers import DEVICE, TRITON_REASON, gpu, interpreted_on_cpu
from tests.tiny import make_drafter, make_target

pytest.importorskip("triton", reason=TRITON_REASON)

DTYPES = [torch.float32, torch.float16, gpu(torch.bfloat16)]


@pytest.fixture(autouse=True)
def _deterministic(monkeypatch: pytest.MonkeyPatch, set_settings) -> None:
    interpreted_on_cpu(monkeypatch)
    set_settings(deterministic=True)


def _rows_alone_and_together(fn, x: torch.Tensor, picks: list[int]) -> None:
    """fn over every row of x at once equals fn over each picked row alone, and over the picked
    rows in a smaller batch, bit for bit."""
    whole = fn(x)
    some = fn(x[picks])
    for i, r in enumerate(picks):
        alone = fn(x[r:r + 1])
        assert torch.equal(whole[r], alone[0]), f"row {r}: alone differs from {x.shape[0]} rows"
        assert torch.equal(whole[r], some[i]), f"row {r}: differs in a batch of {len(picks)}"


@pytest.mark.parametrize("K", [64, 300], ids=["whole", "split"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["norm", "plain", "glu"])
def test_projection_rows_sum_alike_at_any_row_count(kind, dtype, K):
    """Inputs of one step are read whole; more in input splits added in order."""
    split = K > 64
    gen = torch.Generator().manual_seed(1)
    N = 96
    normed = kind != "plain"
    w = (torch.randn(2 * N if kind == "glu" else N, K, generator=gen) / 8).to(dtype).to(DEVICE)
    g = torch.rand(K, generator=gen).to(dtype).to(DEVICE) if normed else None
    b = torch.randn(N, generator=gen).to(dtype).to(DEVICE) if not normed else None
    # a row: its input, and for the normed kinds the residual delta added to it first
    x = torch.randn(70, 2 * K if normed else K, generator=gen).to(dtype).to(DEVICE)

    def project(rows):
        delta = rows[:, K:].contiguous() if normed else None
        return gemm_kernel.launch(kind, rows[:, :K].contiguous(), delta, g, 1e-6, w, b, invariant=True)[1]
    assert (gemm_kernel.invariant_split(kind, N, K) > 1) == split
    _rows_alone_and_together(project, x, [0, 17, 33, 69])
    h = x[:, :K].float()
    if normed:
        h = (h + x[:, K:].float()).to(dtype).float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * g.float()
    y = h @ w.float().T + (b.float() if b is not None else 0)
    if kind == "glu":
        y = torch.nn.functional.silu(y[:, :N]) * y[:, N:]
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(project(x).float(), y, atol=tol, rtol=tol)


def test_wide_row_tiles_only_for_16_bit_inputs_on_the_gpu(monkeypatch):
    """A forward of many rows takes 64 or 128 rows a program only where that was shown to give
    each row the bits it gets alone (bf16 on an H200); fp32 tiles that wide overflow shared memory."""
    monkeypatch.setattr(gemm_kernel, "interpreting", lambda: False)
    assert [gemm_kernel.invariant_rows(m, torch.bfloat16) for m in (1, 16, 17, 64, 70, 528)] == [16, 16, 64, 64, 128, 128]
    assert {gemm_kernel.invariant_rows(m, torch.float32) for m in (1, 70, 528)} == {16}
    monkeypatch.setattr(gemm_kernel, "interpreting", lambda: True)
    assert gemm_kernel.invariant_rows(528, torch.bfloat16) == 16


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_norm_kernel_sums_a_row_alike_at_any_row_count(dtype):
    gen = torch.Generator().manual_seed(2)
    D = 1500   # two blocks, the second ragged
    w = torch.rand(D, generator=gen).to(dtype).to(DEVICE)
    x = torch.randn(9, 2 * D, generator=gen).to(dtype).to(DEVICE)

    def norm(rows):
        return torch.cat(norm_kernel.add_rms_norm(rows[:, :D].contiguous(), rows[:, D:].contiguous(), w, 1e-5), -1)
    _rows_alone_and_together(norm, x, [0, 4, 8])
    s = (x[:, :D].float() + x[:, D:].float()).to(dtype)
    want = (s.float() * torch.rsqrt(s.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype) * w
    torch.testing.assert_close(norm(x)[:, D:], want, atol=1e-2, rtol=1e-2)


def test_visible_keys_list_each_tokens_keys_in_order():
    """A forward's mask (`attn_meta`: the context, then some of the W new entries) as a prefix of
    positions from 0 and a tail of at most W positions."""
    intra = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 1, 1]]], dtype=torch.bool)
    meta = attn_meta(torch.tensor([5]), intra, 12)
    vis = invariant_attn.visible_keys(meta.mask)
    for i in range(4):
        want = meta.mask[0, 0, i].nonzero()[:, 0].tolist()
        n, p = int(vis.counts[0, i]), int(vis.prefix[0, i])
        assert list(range(p)) + vis.tail[0, i, :n - p].tolist() == want
    assert vis.prefix[0].tolist() == [6, 7, 6, 5] and vis.counts[0].tolist() == [6, 7, 7, 7]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("paged", [False, True], ids=["rows", "paged"])
def test_attention_gives_a_token_the_same_bits_in_a_decode_a_tree_and_a_prefill(dtype, paged):
    """Token at position p with context 0..p-1: alone (decode), as a DDTree node whose ancestors sit
    among decoy siblings, inside a causal prefill, and split or folded in-program, all equal."""
    gen = torch.Generator().manual_seed(3)
    Hkv, G, hd, ctx = 2, 3, 16, 300   # the context spans two chunks
    path = 5                            # accepted path: positions ctx .. ctx + 4
    keys = torch.randn(ctx + path, Hkv, hd, generator=gen).to(dtype)
    vals = torch.randn(ctx + path, Hkv, hd, generator=gen).to(dtype)
    qs = torch.randn(path, Hkv * G, hd, generator=gen).to(dtype).to(DEVICE)
    scale = hd ** -0.5

    def cache_of(order: list[int], length: int):
        """A cache holding positions `order` at slots 0.. (paged: at shuffled pool slots)."""
        k = torch.zeros(1, Hkv, length, hd, dtype=dtype)
        v = torch.zeros(1, Hkv, length, hd, dtype=dtype)
        for slot, p in enumerate(order):
            if p >= 0:
                k[0, :, slot], v[0, :, slot] = keys[p], vals[p]
        if not paged:
            return k.to(DEVICE), v.to(DEVICE), None
        perm = torch.randperm(length + 7, generator=gen)[:length]
        pk = torch.zeros(1, Hkv, length + 7, hd, dtype=dtype)
        pv = torch.zeros_like(pk)
        pk[0, :, perm], pv[0, :, perm] = k[0], v[0]
        return pk.to(DEVICE), pv.to(DEVICE), perm[None].to(DEVICE)

    def run(k, v, kv_slots, mask, q, inline):
        return invariant_attn.attention(q, k, v, invariant_attn.visible_keys(mask.to(DEVICE)), scale, kv_slots, inline)

    # decode: the token at ctx + i sees positions 0 .. ctx + i
    decodes = []
    for i in range(path):
        L = ctx + i + 1
        k, v, slots = cache_of(list(range(L)), L)
        mask = torch.ones(1, 1, 1, L, dtype=torch.bool)
        decodes.append(run(k, v, slots, mask, qs[i][None, None], inline=False)[0, 0])
    # tree: nodes 0..9 after the context; the path is nodes 0, 2, 3, 6, 9, the rest decoys
    nodes = 10
    on_path = [0, 2, 3, 6, 9]
    order = list(range(ctx)) + [-1] * nodes
    for d, n in enumerate(on_path):
        order[ctx + n] = ctx + d
    k, v, slots = cache_of(order, ctx + nodes)
    for n in range(nodes):
        if n not in on_path:   # decoys: keys no path node may see, written where the mask hides them
            k[..., int(slots[0, ctx + n]) if paged else ctx + n, :] = 7.0
    mask = torch.zeros(1, 1, nodes, ctx + nodes, dtype=torch.bool)
    mask[..., :ctx] = True
    q_tree = torch.randn(1, nodes, Hkv * G, hd, generator=gen).to(dtype).to(DEVICE)
    for d, n in enumerate(on_path):
        q_tree[0, n] = qs[d]
        for a in on_path[:d + 1]:
            mask[0, 0, n, ctx + a] = True
    for n in range(nodes):
        mask[0, 0, n, ctx + n] = True
    for inline in (False, True):
        tree = run(k, v, slots, mask, q_tree, inline)
        for d, n in enumerate(on_path):
            assert torch.equal(tree[0, n], decodes[d]), f"tree node at depth {d} (inline={inline})"
    # prefill: all ctx + path tokens causally, beside a second request of other length
    L = ctx + path
    k, v, slots = cache_of(list(range(L)), L)
    W = 12
    q_pre = torch.randn(2, W, Hkv * G, hd, generator=gen).to(dtype).to(DEVICE)
    q_pre[0, W - path:] = qs
    mask = torch.zeros(2, 1, W, L, dtype=torch.bool)
    mask[0, 0] = causal(1, W, "cpu")[0].new_ones(W, L).tril(L - W)
    mask[1, 0, :, :100] = True
    k2, v2 = (k, v) if paged else (k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1))
    slots2 = slots.expand(2, -1) if paged else None
    for inline in (False, True):
        pre = run(k2, v2, slots2, mask, q_pre, inline)
        for i in range(path):
            assert torch.equal(pre[0, W - path + i], decodes[i]), f"prefill token {i} (inline={inline})"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("det")
    target = make_target(root / "target", "qwen3", vocab=61, scale=3.0)
    return target, make_drafter(root / "drafter", target, block_size=4)


@pytest.mark.parametrize("dtype", [torch.float32, gpu(torch.bfloat16)])
def test_a_target_gives_a_token_the_same_logits_and_features_in_every_phase(pair, dtype):
    """Prefill of all tokens, prefill + decodes, prefill + one tree verify with decoys, and the
    decodes beside another request: the path tokens' logits and captured features are equal."""
    target = load_target(pair[0], dtype, DEVICE)[0]
    cfg: ModelConfig = target.cfg
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, cfg.vocab_size, (20,), generator=gen)
    p, n = 12, 20                                   # prompt 0..11, then 8 path tokens
    layers = (0, cfg.num_layers - 1)

    def cache(rows=1):
        return KVCache.allocate(cfg.num_layers, rows, 64, cfg.num_kv_heads, cfg.head_dim, dtype, DEVICE)

    def forward(kv, ids, start, intra, positions=None, slots=None):
        B, W = ids.shape
        start_t = torch.tensor(start, device=DEVICE)
        meta = attn_meta(start_t, intra.to(DEVICE), 64, slots)
        pos = positions if positions is not None else start_t[:, None] + torch.arange(W, device=DEVICE)
        with torch.no_grad():
            h, aux = target(ids.to(DEVICE), pos.to(DEVICE), meta, kv.k, kv.v, capture_layers=layers)
            return target.logits(h), aux

    whole, whole_aux = forward(cache(), tokens[None], [0], causal(1, n, "cpu"))
    kv = cache()
    forward(kv, tokens[None, :p], [0], causal(1, p, "cpu"))
    steps = [forward(kv, tokens[None, i:i + 1], [i], causal(1, 1, "cpu")) for i in range(p, n)]
    for j, i in enumerate(range(p, n)):
        assert torch.equal(steps[j][0][0, 0], whole[0, i]), f"decode at {i} differs from the prefill"
        assert torch.equal(steps[j][1][0, 0], whole_aux[0, i]), f"features at {i} differ"
    # one tree verify: nodes 0..11 after the prompt, the path at nodes 0, 1, 3, 4, 7, 8, 10, 11
    on_path = [0, 1, 3, 4, 7, 8, 10, 11]
    parent = {}
    for d, node in enumerate(on_path[1:], 1):
        parent[node] = on_path[d - 1]
    for node in (2, 5, 6, 9):
        parent[node] = on_path[node // 3]   # decoys hang off the path
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=gen)
    depth = torch.zeros(12, dtype=torch.long)
    intra = torch.eye(12, dtype=torch.bool)
    for node in range(1, 12):
        a = node
        while a != 0:
            a = parent[a]
            intra[node, a] = True
            depth[node] += 1
    for d, node in enumerate(on_path):
        ids[0, node] = tokens[p + d]
    kv = cache()
    forward(kv, tokens[None, :p], [0], causal(1, p, "cpu"))
    tree, tree_aux = forward(kv, ids, [p], intra[None], positions=(p + depth)[None])
    for d, node in enumerate(on_path):
        assert torch.equal(tree[0, node], whole[0, p + d]), f"tree node at depth {d} differs"
        assert torch.equal(tree_aux[0, node], whole_aux[0, p + d])
    # the decodes again, in a batch beside a request of another length
    kv = cache(2)
    other = torch.randint(0, cfg.vocab_size, (1, 5), generator=gen)
    forward(kv, torch.cat([tokens[None, :p], torch.cat([other, other, other[:, :2]], 1)]), [0, 0],
            causal(2, p, "cpu"))
    for i in range(p, n):
        both, _ = forward(kv, torch.stack([tokens[i:i + 1], other[0, :1]]), [i, i], causal(2, 1, "cpu"))
        assert torch.equal(both[0, 0], whole[0, i]), f"batched decode at {i} differs"


def test_speculative_decoding_repeats_plain_decoding(pair):
    """End to end in the mode (on CPU fp32 through the interpreter's kernels): DDTree, greedy and
    seeded sampling in one batch. (The bits themselves: the test above.)"""
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=5)]
    outs = {}
    for spec, budget in (("none", None), ("ddtree", 6)):
        llm = LLM(model=str(pair[0]), draft_model=str(pair[1]), spec=spec, budget=budget, device=DEVICE,
                  deterministic=True)
        outs[spec] = [o.token_ids for o in llm.generate(prompts, params)]
        llm.shutdown()
    assert outs["ddtree"] == outs["none"]


def test_the_drafter_keeps_the_fast_kernels(pair, monkeypatch):
    """Only the target's numerics reach committed tokens: in the mode every kernel choice of the
    target's forwards is the invariant one, every one of the drafter's (its own layers and the LM
    head it borrows) the fast one."""
    from drafttree.kernels import dispatch
    from drafttree.models import dflash
    seen: dict[str, set[bool]] = {"target": set(), "drafter": set()}
    inside = []
    invariant = dispatch.invariant

    def spy(x):
        answer = invariant(x)
        seen["drafter" if inside else "target"].add(answer)
        return answer

    for name in ("forward", "write_context", "draft_logits"):
        method = getattr(dflash.DFlashDrafter, name)

        def wrapped(self, *args, _method=method, **kwargs):
            inside.append(1)
            try:
                return _method(self, *args, **kwargs)
            finally:
                inside.pop()
        monkeypatch.setattr(dflash.DFlashDrafter, name, wrapped)
    monkeypatch.setattr(dispatch, "invariant", spy)
    llm = LLM(model=str(pair[0]), draft_model=str(pair[1]), spec="ddtree", budget=6, device=DEVICE,
              deterministic=True)
    llm.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    llm.shutdown()
    assert seen == {"target": {True}, "drafter": {False}}


def test_moe_and_mla_targets_are_refused_before_loading(tmp_path):
    from tests.moe_tiny import make_moe_target
    target = make_moe_target(tmp_path / "q", "qwen3_moe")
    with pytest.raises(ValueError, match="deterministic mode covers dense Llama, Qwen2 and Qwen3 targets"):
        LLM(model=str(target), device=DEVICE, deterministic=True)


def _reduce_on_ranks(tp, shapes):
    """Each rank's addends (a function of its rank) all-reduced in deterministic mode; rank 0
    returns the sums and every rank's copy of them."""
    from drafttree.parallel.comm import all_reduce, gather_first
    from drafttree.settings import current, install
    install(current().replace(deterministic=True))
    out = []
    for shape in shapes:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(100 + tp.rank)) * 10 ** tp.rank
        y = all_reduce(x.clone(), tp)
        out.append((y, gather_first(y, tp)))
    return out


def test_more_than_two_ranks_add_their_parts_in_rank_order():
    """Over 3 ranks (gloo) the row-parallel sums are the ranks' parts added in rank order, the same
    bits on every rank, whatever the message size."""
    from drafttree.engine.launch import run_ranks
    shapes = [(1, 5), (33, 7)]
    got = run_ranks(_reduce_on_ranks, 3, "cpu", 60.0, shapes)
    for shape, (y, copies) in zip(shapes, got):
        parts = [torch.randn(shape, generator=torch.Generator().manual_seed(100 + r)) * 10 ** r for r in range(3)]
        assert torch.equal(y, (parts[0] + parts[1]) + parts[2])
        assert all(torch.equal(c, y) for c in copies)
