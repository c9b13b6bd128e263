"""The few-row attention kernel against softmax attention in torch, and on the decode path.

Without CUDA the kernel runs under the Triton interpreter on CPU (conftest.py turns it on).
"""
from __future__ import annotations

import pytest
import torch

from drafttree.kernels import attn_kernel, dispatch, torch_ops
from drafttree.settings import using
from tests.helpers import DEVICE, TRITON_REASON, gpu, greedy, interpreted_on_cpu, make_prompts

pytest.importorskip("triton", reason=TRITON_REASON)


@pytest.fixture(autouse=True)
def _kernel_device(monkeypatch: pytest.MonkeyPatch, set_settings) -> None:
    interpreted_on_cpu(monkeypatch)
    set_settings(attn_kernel=True)


def reference(q, k, v, mask, scale):
    """q [B, W, H, hd] token-major, as the kernel takes it; the same layout out."""
    B, W, H, hd = q.shape
    Hkv = k.shape[1]
    g = H // Hkv
    qg = q.view(B, W, Hkv, g, hd).permute(0, 2, 3, 1, 4).reshape(B, Hkv, g * W, hd)
    grouped = mask.expand(B, g, W, mask.shape[-1]).reshape(B, 1, g * W, -1)
    s = (qg.double() @ k.double().transpose(-1, -2)) * scale
    out = s.masked_fill(~grouped, float("-inf")).softmax(-1) @ v.double()
    return out.view(B, Hkv, g, W, hd).permute(0, 3, 1, 2, 4).reshape(B, W, H, hd)


@pytest.mark.parametrize("B,Hkv,g,W,L,hd", [
    (1, 2, 4, 1, 200, 16),     # decode, several splits, a ragged last block
    (3, 1, 2, 33, 130, 32),    # verify-wide: 66 rows take two row blocks
    (2, 2, 1, 5, 64, 16),      # one key block
    (1, 1, 3, 7, 700, 64),
])
@pytest.mark.parametrize("dtype", [torch.float32, gpu(torch.bfloat16)])   # bf16 dots are not interpreted
def test_matches_softmax_attention(B, Hkv, g, W, L, hd, dtype):
    gen = torch.Generator().manual_seed(B * 1000 + L)
    rows, max_len = B + 2, L + 50   # the kernel reads views of a larger cache
    k_cache = torch.randn(rows, Hkv, max_len, hd, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn(rows, Hkv, max_len, hd, generator=gen).to(dtype).to(DEVICE)
    # q strided as a slice of a fused QKV projection's output
    qkv = torch.randn(B, W, (g + 2) * Hkv, hd, generator=gen).to(dtype).to(DEVICE)
    q = qkv[:, :, :g * Hkv]
    mask = torch.rand(B, 1, W, L, generator=gen) < 0.3
    mask[..., L // 2:] = False                          # whole blocks nobody sees
    mask[:, :, torch.arange(W), torch.arange(W) * 3 % L] = True   # every row sees something
    mask = mask.to(DEVICE)
    k, v = k_cache[:B, :, :L], v_cache[:B, :, :L]
    out = attn_kernel.few_row_attention(q, k, v, mask, hd ** -0.5)
    want = reference(q, k, v, mask, hd ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.shape == (B, W, g * Hkv, hd) and out.is_contiguous()
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("target_programs", [1, 10_000])   # one split (no merge launch); many
def test_one_split_skips_the_merge(monkeypatch, target_programs):
    gen = torch.Generator().manual_seed(target_programs)
    B, Hkv, g, W, L, hd = 2, 2, 3, 9, 300, 32
    k, v = (torch.randn(B, Hkv, L, hd, generator=gen).to(DEVICE) for _ in range(2))
    q = torch.randn(B, W, g * Hkv, hd, generator=gen).to(DEVICE)
    mask = torch.rand(B, 1, W, L, generator=gen) < 0.5
    mask[..., 0] = True
    mask = mask.to(DEVICE)
    monkeypatch.setattr(attn_kernel, "TARGET_PROGRAMS", target_programs)
    launched = []
    jit = attn_kernel.jit_kernel
    monkeypatch.setattr(attn_kernel, "jit_kernel", lambda fn, *a: launched.append(fn.__name__) or jit(fn, *a))
    out = attn_kernel.few_row_attention(q, k, v, mask, hd ** -0.5)
    torch.testing.assert_close(out.double(), reference(q, k, v, mask, hd ** -0.5), atol=1e-5, rtol=1e-5)
    assert ("_merge_kernel" in launched) == (target_programs > 1), launched


def test_split_plan():
    """About TARGET_PROGRAMS programs where the batch is small, whole chunks where it is large,
    and never more than MAX_SPLITS splits to merge, however long the context."""
    bn = attn_kernel.BLOCK_N
    assert attn_kernel.plan_split_blocks(8, 1024) == 1                  # batch 1: 16 splits
    assert attn_kernel.plan_split_blocks(384, 1024) == attn_kernel.MAX_SPLIT_BLOCKS
    for programs in (1, 8, 384):
        for L in (64, 1024, 2048, 65536, 131072, 1 << 20):
            per = attn_kernel.plan_split_blocks(programs, L)
            assert per & (per - 1) == 0 and -(-L // (per * bn)) <= attn_kernel.MAX_SPLITS


def test_refuses_a_mask_that_does_not_fit():
    q = torch.zeros(1, 6, 2, 16, device=DEVICE)
    k = torch.zeros(1, 1, 32, 16, device=DEVICE)
    with pytest.raises(ValueError, match="few_row_attention"):
        attn_kernel.few_row_attention(q, k, k, torch.ones(1, 1, 4, 32, dtype=torch.bool, device=DEVICE), 1.0)


@pytest.mark.parametrize("shape,spec,budget", [("qwen3", "none", None), ("qwen3", "ddtree", 4),
                                               ("llama", "dflash", None)])
def test_decode_through_the_kernels_is_lossless(zoo, monkeypatch, shape, spec, budget):
    """Prefill's KV writes, and decode, draft and verify attention, through the kernels (q/k
    norm where the shape has it, rope, KV write, attention) give plain greedy's tokens through
    the torch ops."""
    from drafttree.llm import LLM
    pair = zoo(shape)
    prompts = make_prompts(pair.vocab)[:2]
    with using(attn_kernel=False):
        want = [pair.plain(p, 5) for p in prompts]   # interpreted kernels are slow: a few steps
    ran = []
    monkeypatch.setattr(dispatch, "few_rows", lambda q, rows: True)
    real = attn_kernel._attention
    # (q, H, k, v, mask, scale, rope, kv_slots): paged, with the rope inside for decode tokens
    monkeypatch.setattr(attn_kernel, "_attention", lambda *a: ran.append((a[6] is not None, a[7] is not None))
                        or real(*a))
    llm = LLM(model=str(pair.target), draft_model=None if spec == "none" else str(pair.drafter), spec=spec,
              budget=budget, device=DEVICE, dtype="float32", max_num_seqs=2, max_model_len=128)
    assert [o.token_ids for o in llm.generate(prompts, greedy(5))] == want
    assert ran and all(paged for _, paged in ran)
    assert any(r for r, _ in ran) == (spec == "none")   # the rope inside the attention: one-token decodes only


@pytest.mark.parametrize("shape", ["qwen3", "llama"])
def test_drafter_attention_through_the_kernels(zoo, monkeypatch, tmp_path, shape):
    """A drafter layer's attention through the kernels (the context's and the block's QKV rows
    in one q/k norm + rope + KV write launch, then the block's queries) drafts what its torch ops
    draft, round for round: the same draft logits, not only the target's tokens."""
    from drafttree.llm import LLM
    from drafttree.models import dflash
    from tests.tiny import edit_tensors, make_drafter
    pair = zoo(shape)
    prompts = make_prompts(pair.vocab)[:2]
    gen = torch.Generator().manual_seed(5)
    drafter = edit_tensors(make_drafter(tmp_path / "drafter", pair.target, head_dim=16),   # a head dim tl.dot takes
                           lambda w: {k: (1 + torch.randn(v.shape, generator=gen) / 3 if k.endswith("_norm.weight")
                                          else v) for k, v in w.items()})   # q and k norms apart
    real_logits = dflash.DFlashDrafter.draft_logits

    def run(kernels: bool) -> tuple[list[list[int]], list[torch.Tensor]]:
        drafted, kernel_calls = [], []
        with monkeypatch.context() as m, using(attn_kernel=kernels):
            m.setattr(dispatch, "few_rows", lambda q, rows: True)
            m.setattr(dflash.DFlashDrafter, "draft_logits", lambda d, *a: drafted.append(real_logits(d, *a).clone())
                      or drafted[-1])
            real_attend = dflash.DraftLayer._attend_kernel
            m.setattr(dflash.DraftLayer, "_attend_kernel", lambda *a: kernel_calls.append(1) or real_attend(*a))
            llm = LLM(model=str(pair.target), draft_model=str(drafter), spec="ddtree", budget=4, device=DEVICE,
                      dtype="float32", max_num_seqs=2, max_model_len=128, cuda_graphs=False)
            out = [o.token_ids for o in llm.generate(prompts, greedy(5))]
        assert bool(kernel_calls) == kernels
        return out, drafted

    want, want_drafts = run(False)
    got, got_drafts = run(True)
    assert got == want and len(got_drafts) == len(want_drafts) > 0
    for g, w in zip(got_drafts, want_drafts):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_write_kv_matches_index_put():
    """One launch for K and V, against the indexed assignment, with V a strided view (as from the
    fused QKV projection) and rows that are not 0..B-1."""
    gen = torch.Generator().manual_seed(3)
    B, W, Hkv, hd, rows_n, L = 3, 5, 3, 16, 6, 40
    k = torch.randn(B, W, Hkv, hd, generator=gen).to(DEVICE)
    v = torch.randn(B, W, 2 * Hkv, hd, generator=gen).to(DEVICE)[:, :, Hkv:]
    rows = torch.tensor([[4], [0], [2]], device=DEVICE)
    slots = torch.stack([torch.randperm(L, generator=gen)[:W] for _ in range(B)]).to(DEVICE)
    kc, vc = torch.zeros(2, rows_n, Hkv, L, hd, device=DEVICE)
    want_k, want_v = kc.clone(), vc.clone()
    want_k[rows, :, slots] = k
    want_v[rows, :, slots] = v
    attn_kernel.write_kv(kc, vc, rows, slots, k, v)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


def test_kernels_keep_off_gpus_older_than_ampere(monkeypatch):
    """bf16 tl.dot needs sm80+: an older CUDA device keeps the torch ops, without a compile error."""
    from drafttree.kernels import triton_jit
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(triton_jit, "kernels_run_on", lambda device: True)
    monkeypatch.setattr(triton_jit, "_capability", lambda index: (7, 5))
    assert not triton_jit.dots_run_on("cuda:0")
    monkeypatch.setattr(triton_jit, "_capability", lambda index: (8, 0))
    assert triton_jit.dots_run_on("cuda:0")


@pytest.mark.parametrize("heads,kv_heads,hd,norm", [(4, 2, 16, True), (3, 1, 32, False), (8, 8, 16, True)])
def test_qk_rope_write_kv_matches_the_torch_ops(heads, kv_heads, hd, norm):
    """q/k norm, rope and the cache write in one launch, against the torch ops; and the torch
    fallback `dispatch` takes with the attention kernels off, against the same."""
    from drafttree.kernels.rope_kernel import qk_rope_write_kv
    gen = torch.Generator().manual_seed(heads * 10 + hd)
    B, W, L = 2, 5, 24
    qkv = torch.randn(B, W, (heads + 2 * kv_heads) * hd, generator=gen).to(DEVICE)
    qw, kw = (1 + torch.randn(2, hd, generator=gen) / 4).to(DEVICE)
    pos = torch.randint(0, 1000, (B, W), generator=gen).to(DEVICE)
    ang = pos[..., None].float() * (1.0 / 10000 ** (torch.arange(0, hd, 2, device=DEVICE) / hd))
    emb = torch.cat((ang, ang), -1)[:, :, None, :]
    cos, sin = emb.cos(), emb.sin()
    rows = torch.tensor([[1], [0]], device=DEVICE)
    slots = torch.stack([torch.randperm(L, generator=gen)[:W] for _ in range(B)]).to(DEVICE)
    kc, vc = torch.zeros(2, 3, kv_heads, L, hd, device=DEVICE)
    q = qk_rope_write_kv(qkv, heads, kv_heads, qw if norm else None, kw if norm else None, 1e-6, cos, sin,
                         kc, vc, rows, slots)
    wq, wk, wv = qkv.view(B, W, -1, hd).split([heads, kv_heads, kv_heads], dim=2)
    if norm:
        wq, wk = torch_ops._rms_norm(wq, qw, 1e-6), torch_ops._rms_norm(wk, kw, 1e-6)
    wq, wk = torch_ops._rope(wq, cos, sin), torch_ops._rope(wk, cos, sin)
    want_k, want_v = torch.zeros_like(kc), torch.zeros_like(vc)
    want_k[rows, :, slots], want_v[rows, :, slots] = wk, wv
    torch.testing.assert_close(q, wq, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kc, want_k, atol=1e-5, rtol=1e-5)
    assert torch.equal(vc, want_v)
    tc, tv = torch.zeros_like(kc), torch.zeros_like(vc)
    with using(attn_kernel=False):
        tq = dispatch.qk_rope_write_kv(qkv, heads, kv_heads, qw if norm else None, kw if norm else None, 1e-6, cos,
                                       sin, tc, tv, rows, slots)
    torch.testing.assert_close(tq, wq, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tc, want_k, atol=1e-5, rtol=1e-5)
    assert torch.equal(tv, want_v)


@pytest.mark.parametrize("B,heads,kv_heads,W,L,hd,norm", [
    (1, 4, 2, 1, 200, 16, True),     # decode: several splits, one of them holds the new slot
    (2, 6, 2, 33, 130, 32, False),   # verify-wide: 99 rows in several row blocks (each writes its
                                     # split's slots, the same values); slots in both splits
    (1, 3, 3, 5, 64, 16, True),      # one split: no merge
])
def test_rope_attention_equals_rope_kernel_then_attention(monkeypatch, B, heads, kv_heads, W, L, hd, norm):
    """Norm, rope and the KV write inside the attention launch give the same output and the same
    cache as `qk_rope_write_kv` followed by `few_row_attention`."""
    from drafttree.kernels.rope_kernel import qk_rope_write_kv
    monkeypatch.setattr(attn_kernel, "TARGET_PROGRAMS", 64)   # small shapes still split
    gen = torch.Generator().manual_seed(W * 100 + L)
    qkv = torch.randn(B, W, (heads + 2 * kv_heads) * hd, generator=gen).to(DEVICE)
    qw, kw = (1 + torch.randn(2, hd, generator=gen) / 4).to(DEVICE)
    ang = torch.randint(0, 1000, (B, W, 1), generator=gen).float() * torch.rand(hd // 2, generator=gen)
    emb = torch.cat((ang, ang), -1)[:, :, None, :].to(DEVICE)
    edges = [e for e in dict.fromkeys((127, 64, 63, 128, L - 1)) if e < L]   # split edges (64-key splits), once each
    rest = [[s for s in torch.randperm(L, generator=gen).tolist() if s not in edges] for _ in range(B)]
    slots = torch.tensor([(edges[b % 2:] + rest[b])[:W] for b in range(B)]).to(DEVICE)
    mask = torch.rand(B, 1, W, L, generator=gen) < 0.4
    mask[torch.arange(B)[:, None], 0, torch.arange(W)[None, :], slots.cpu()] = True   # each sees itself
    mask = mask.to(DEVICE)
    cache = torch.randn(2, B + 1, kv_heads, L + 8, hd, generator=gen).to(DEVICE)
    weights = (qw, kw) if norm else (None, None)
    want_k, want_v = cache.clone()
    q = qk_rope_write_kv(qkv, heads, kv_heads, *weights, 1e-6, emb.cos(), emb.sin(), want_k, want_v,
                         torch.arange(B, device=DEVICE)[:, None], slots)
    want = attn_kernel.few_row_attention(q, want_k[:B, :, :L], want_v[:B, :, :L], mask, hd ** -0.5)
    kc, vc = cache.clone()
    rope = attn_kernel.Rope(*weights, 1e-6, emb.cos(), emb.sin(), slots)
    out = attn_kernel.rope_attention(qkv, heads, kc[:B, :, :L], vc[:B, :, :L], mask, hd ** -0.5, rope)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)


def test_jit_kernel_refuses_an_unknown_argument_name():
    from drafttree.kernels.triton_jit import jit_kernel
    with pytest.raises(ValueError, match="no argument"):
        jit_kernel(attn_kernel._merge_kernel, True, ("NOT_AN_ARG",))


def _paged(gen, B, Hkv, L, hd, ps=16):
    """Pools [1, Hkv, slots, hd] and each row's positions 0..L-1 scattered over shuffled pages."""
    per_row = -(-L // ps)
    pages = 1 + B * per_row + 2
    pools = torch.randn(2, 1, Hkv, pages * ps, hd, generator=gen)
    table = (torch.randperm(pages - 1, generator=gen)[:B * per_row] + 1).view(B, per_row)
    pos = torch.arange(L)
    return pools[0].to(DEVICE), pools[1].to(DEVICE), (table[:, pos // ps] * ps + pos % ps).to(DEVICE)


@pytest.mark.parametrize("B,Hkv,g,W,L,hd", [(2, 2, 2, 1, 200, 16), (3, 1, 2, 9, 130, 32)])
def test_paged_attention_reads_through_the_slots(B, Hkv, g, W, L, hd):
    """Over a paged pool the kernel reads position n of row b at kv_slots[b, n]: the attention
    of the gathered copy."""
    gen = torch.Generator().manual_seed(L + W)
    k_pool, v_pool, kv_slots = _paged(gen, B, Hkv, L, hd)
    q = torch.randn(B, W, g * Hkv, hd, generator=gen).to(DEVICE)
    mask = torch.rand(B, 1, W, L, generator=gen) < 0.3
    mask[:, :, torch.arange(W), torch.arange(W) * 3 % L] = True
    mask = mask.to(DEVICE)
    out = attn_kernel.few_row_attention(q, k_pool, v_pool, mask, hd ** -0.5, kv_slots)
    k, v = torch_ops.gather_slots(k_pool, kv_slots), torch_ops.gather_slots(v_pool, kv_slots)
    torch.testing.assert_close(out.double(), reference(q, k, v, mask, hd ** -0.5), atol=1e-5, rtol=1e-5)


def test_paged_rope_attention_writes_its_slot_and_reads_through_the_slots(monkeypatch):
    """A decode token's rope, KV write and attention in one launch over a paged pool: the pool
    and output of the rope kernel's write followed by the paged attention."""
    from drafttree.kernels.rope_kernel import qk_rope_write_kv
    monkeypatch.setattr(attn_kernel, "TARGET_PROGRAMS", 64)   # several splits: one holds the new position
    B, heads, kv_heads, L, hd = 2, 4, 2, 200, 16
    gen = torch.Generator().manual_seed(5)
    k_pool, v_pool, kv_slots = _paged(gen, B, kv_heads, L, hd)
    qkv = torch.randn(B, 1, (heads + 2 * kv_heads) * hd, generator=gen).to(DEVICE)
    ang = torch.randint(0, 1000, (B, 1, 1), generator=gen).float() * torch.rand(hd // 2, generator=gen)
    emb = torch.cat((ang, ang), -1)[:, :, None, :].to(DEVICE)
    positions = torch.tensor([[150], [70]], device=DEVICE)
    slots = kv_slots.gather(1, positions)
    mask = (torch.arange(L, device=DEVICE) <= positions[:, :, None])[:, None]
    want_k, want_v = k_pool.clone(), v_pool.clone()
    q = qk_rope_write_kv(qkv, heads, kv_heads, None, None, 1e-6, emb.cos(), emb.sin(), want_k, want_v,
                         torch.zeros(B, 1, dtype=torch.long, device=DEVICE), slots)
    want = attn_kernel.few_row_attention(q, want_k, want_v, mask, hd ** -0.5, kv_slots)
    kc, vc = k_pool.clone(), v_pool.clone()
    rope = attn_kernel.Rope(None, None, 1e-6, emb.cos(), emb.sin(), slots, positions)
    out = attn_kernel.rope_attention(qkv, heads, kc, vc, mask, hd ** -0.5, rope, kv_slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)
