"""MoE and MLA targets on the paged KV pool, through the scheduler (fp32, CPU): pages of 4 tokens,
prefix caching on and off, preemption on a small pool, a follow-up turn over generated pages.
Plain greedy decoding, DFlash and DDTree give the same tokens, which are transformers' own; every
page comes back. An MLA target's pool holds its latent in K and nothing in V."""
from __future__ import annotations

import pytest
import torch

from drafttree.loader.weights import load_target
from drafttree.models import mla
from drafttree.models.kv_cache import KVLayout, PagedKVCache
from tests.helpers import (Pair, greedy, make_llm, make_prompts, next_turn_reuses_generated_pages, pool_gb,
                           pool_is_whole)
from tests.moe_tiny import PAGED_PAGE_SIZE, PAGED_PAGES, paged_logits

SPECS = [("none", None, None), ("dflash", 4, None), ("ddtree", 4, 8)]
MLA_SHAPES = ["deepseek_v3", "deepseek_v3_plain"]


_HF_MODELS: dict = {}   # target path -> its transformers model


def hf_greedy(pair: Pair, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    if pair.target not in _HF_MODELS:
        _HF_MODELS[pair.target] = AutoModelForCausalLM.from_pretrained(pair.target, dtype=torch.float32).eval()
    x = torch.tensor([prompt])
    with torch.no_grad():
        out = _HF_MODELS[pair.target].generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                                               min_new_tokens=n, do_sample=False, pad_token_id=-1)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("absorbed", [True, False])
@pytest.mark.parametrize("shape", MLA_SHAPES)
def test_mla_reads_its_latent_through_the_block_table(moe_zoo, monkeypatch, shape, absorbed):
    """Prompts fed in chunks into pages of 4 in shuffled order (the pool's own layout: a K pool
    of the latent's width, a V pool of no bytes), MLA absorbed or expanded: transformers' logits."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(mla, "ABSORBED_MAX_ROWS", 10**6 if absorbed else 0)
    pair = moe_zoo(shape)
    model, cfg = load_target(pair.target, torch.float32, "cpu")
    kv = PagedKVCache.allocate(KVLayout.of(cfg), PAGED_PAGES, PAGED_PAGE_SIZE, torch.float32, "cpu")
    assert kv.k.shape[-1] == cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim and kv.v.numel() == 0
    got = paged_logits(model, cfg, kv)
    ids = torch.randint(0, cfg.vocab_size, (2, 37), generator=torch.Generator().manual_seed(0))   # paged_logits'
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(pair.target, dtype=torch.float32).eval()(ids).logits
    assert float((got - want).norm() / want.norm()) < 1e-4
    assert kv.k[:, 0, 0, :PAGED_PAGE_SIZE].abs().sum() == 0, "the null page was written"


@pytest.mark.parametrize("spec,block_size,budget", SPECS)
@pytest.mark.parametrize("shape", ["qwen3_moe", *MLA_SHAPES])
def test_small_pages_match_transformers(moe_zoo, shape, spec, block_size, budget):
    """Pages of 4 tokens (a verify's budget + 1 nodes, a draft block and commits cross pages), six
    requests through three rows: transformers' greedy tokens, and the pool whole afterwards."""
    pair = moe_zoo(shape)
    prompts = make_prompts(pair.vocab, lens=(30, 1, 12, 7, 2, 19), seed=5)
    max_tokens = [5, 40, 17, 29, 1, 11]
    llm = make_llm(pair, spec, block_size, budget, page_size=4)
    outs = llm.generate(prompts, [greedy(n) for n in max_tokens])
    for p, n, out in zip(prompts, max_tokens, outs):
        assert out.token_ids == hf_greedy(pair, p, n), (shape, spec, len(p))
    if spec != "none":
        assert max(t for o in outs for t in o.metrics["accept_lengths"]) >= 2, "no draft token accepted"
    pool_is_whole(llm)


@pytest.mark.parametrize("spec,block_size,budget", SPECS)
@pytest.mark.parametrize("shape", ["qwen3_moe", "deepseek_v3"])
def test_prefix_cache_on_and_off(moe_zoo, shape, spec, block_size, budget):
    """Requests sharing a 40-token system prompt: with prefix caching they reuse its pages (the
    latent pages too), without it they compute them; the same tokens and accepted lengths either
    way, and they are plain decoding's."""
    pair = moe_zoo(shape)
    system = make_prompts(pair.vocab, lens=(40,), seed=3)[0]
    prompts = [system + t for t in make_prompts(pair.vocab, lens=(3, 9, 1, 5), seed=4)]
    outs, taus = {}, {}
    for caching in (False, True):
        llm = make_llm(pair, spec, block_size, budget, page_size=8, enable_prefix_caching=caching)
        first = llm.generate(prompts[:1], greedy(20))
        rest = llm.generate(prompts[1:], greedy(20))
        outs[caching] = [o.token_ids for o in first + rest]
        taus[caching] = [o.metrics["accept_lengths"] for o in first + rest]
        hits = llm.engine.stats.prefix_cache_hits
        assert hits >= 3 * 40 // 8 * 8 if caching else hits == 0, hits
        pool_is_whole(llm)
    assert outs[True] == outs[False] == [pair.plain(p, 20) for p in prompts]
    assert taus[True] == taus[False]


@pytest.mark.parametrize("spec,block_size,budget", SPECS)
@pytest.mark.parametrize("shape", ["qwen3_moe", "deepseek_v3"])
def test_preemption_recomputes_the_same_tokens(moe_zoo, shape, spec, block_size, budget):
    """A pool of 40 pages of 4 tokens (sized by each pool's own widths: the MLA target's latent
    only) for three rows of up to ~90 positions: requests are preempted and recomputed, and give
    plain decoding's tokens."""
    pair = moe_zoo(shape)
    prompts = make_prompts(pair.vocab, lens=(30, 25, 12, 28, 20), seed=6)
    max_tokens = [40, 40, 35, 40, 30]
    gb = pool_gb(pair, spec, block_size, budget, pages=40, page_size=4)
    llm = make_llm(pair, spec, block_size, budget, page_size=4, kv_cache_memory_gb=gb)
    assert llm.engine.pool.num_pages == 40
    outs = llm.generate(prompts, [greedy(n) for n in max_tokens])
    assert llm.engine.stats.preemptions > 0
    for p, n, out in zip(prompts, max_tokens, outs):
        assert out.token_ids == pair.plain(p, n), (shape, spec, len(p))
    pool_is_whole(llm)


@pytest.mark.parametrize("spec,block_size,budget", SPECS[1:])
def test_generated_latent_pages_serve_the_next_turn(moe_zoo, spec, block_size, budget):
    """The latent entries a verify wrote and its commit moved are final: a follow-up turn takes
    the answer's pages from the prefix cache and still decodes plain decoding's tokens."""
    pair = moe_zoo("deepseek_v3")
    next_turn_reuses_generated_pages(pair, spec, block_size, budget)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["qwen3_moe", "deepseek_v3"])
def test_graphed_rounds_over_pages_on_gpu(moe_zoo, shape):
    """On CUDA with the rounds captured as graphs: pages of 4, then a 40-page pool that preempts;
    DFlash and DDTree give eager plain decoding's tokens, no graph falls back, the pool comes back."""
    pair = moe_zoo(shape)
    prompts = make_prompts(pair.vocab, lens=(30, 25, 12, 28, 20), seed=6)
    cuda = {"device": "cuda", "max_num_seqs": 4, "page_size": 4}
    want = [o.token_ids for o in make_llm(pair, "none", None, None, cuda_graphs=False, **cuda).generate(
        prompts, greedy(40))]
    for spec, block_size, budget in SPECS:
        gb = pool_gb(pair, spec, block_size, budget, pages=40, cuda_graphs=False, **cuda)
        for pool in ({}, {"kv_cache_memory_gb": gb}):
            llm = make_llm(pair, spec, block_size, budget, cuda_graphs=True, **cuda, **pool)
            assert [o.token_ids for o in llm.generate(prompts, greedy(40))] == want, (spec, pool)
            assert llm.engine.runner.graphs.fallbacks == 0
            assert (llm.engine.stats.preemptions > 0) == bool(pool)
            pool_is_whole(llm)
