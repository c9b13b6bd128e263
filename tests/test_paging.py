"""The paged KV cache and its scheduler: small pages, prefix caching, preemption, aborts and the
pool's accounting give plain decoding's tokens, and every page comes back."""
from __future__ import annotations

import dataclasses

import pytest

from drafttree import SamplingParams
from drafttree.engine.pages import PagePool
from drafttree.engine.scheduler import Scheduler, SchedulerConfig
from drafttree.engine.sequence import Sequence
from drafttree.runner.model_runner import CacheConfig
from tests.helpers import (greedy, make_llm, make_prompts, next_turn_reuses_generated_pages, pool_gb,
                           pool_is_whole)

SPECS = [("none", None, None), ("dflash", 4, None), ("ddtree", 4, 8)]


@pytest.mark.parametrize("spec,block_size,budget", SPECS)
def test_small_pages_match_plain(zoo, spec, block_size, budget):
    """Pages of 4 tokens (a verify's nodes, a draft block and every commit cross pages), six
    requests through three rows: plain decoding's tokens, and the pool whole afterwards."""
    pair = zoo("llama")
    prompts = make_prompts(pair.vocab, lens=(30, 1, 12, 7, 2, 19), seed=5)
    max_tokens = [5, 40, 17, 29, 1, 11]
    llm = make_llm(pair, spec, block_size, budget, page_size=4)
    outs = llm.generate(prompts, [greedy(n) for n in max_tokens])
    for p, n, out in zip(prompts, max_tokens, outs):
        assert out.token_ids == pair.plain(p, n), len(p)
    pool_is_whole(llm)


@pytest.mark.parametrize("spec,block_size,budget", SPECS[1:])
def test_small_pages_sampled_same_seed(zoo, spec, block_size, budget):
    """At T > 0 the same seed gives plain decoding's tokens through pages of 4 as well."""
    pair = zoo("qwen3")
    prompts = make_prompts(pair.vocab, lens=(9, 3, 21), seed=2)
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=10 + i, max_tokens=30, ignore_eos=True)
              for i in range(3)]
    want = [o.token_ids for o in make_llm(pair, "none", None, None, max_num_seqs=1).generate(prompts, params)]
    llm = make_llm(pair, spec, block_size, budget, page_size=4)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    pool_is_whole(llm)


@pytest.mark.parametrize("spec,block_size,budget", [SPECS[0], SPECS[2]])
def test_prefix_cache_hits_and_same_tokens(zoo, spec, block_size, budget):
    """Requests sharing a 40-token system prompt: with prefix caching they reuse its pages (hits
    counted), and every output is the one without it, which is plain decoding's. The drafter's
    context pages are shared too: its drafts, so the accepted lengths, are the same."""
    pair = zoo("llama")
    system = make_prompts(pair.vocab, lens=(40,), seed=3)[0]
    tails = make_prompts(pair.vocab, lens=(3, 9, 1, 5, 14), seed=4)
    prompts = [system + t for t in tails]
    outs, taus = {}, {}
    for caching in (False, True):
        llm = make_llm(pair, spec, block_size, budget, page_size=8, enable_prefix_caching=caching)
        # the first request alone fills the cache; the others, together, find it
        first = llm.generate(prompts[:1], greedy(20))
        rest = llm.generate(prompts[1:], greedy(20))
        outs[caching] = [o.token_ids for o in first + rest]
        taus[caching] = [o.metrics["accept_lengths"] for o in first + rest]
        stats = llm.engine.stats
        if caching:
            assert stats.prefix_cache_hits >= 4 * 40 // 8 * 8, stats
            assert 0 < stats.prefix_cache_hit_rate < 1
        else:
            # n > 1 choices share their prompt's pages either way: no cache hit without caching
            llm.generate(prompts[:1], dataclasses.replace(greedy(4), n=2))
            assert llm.engine.stats.prefix_cache_hits == llm.engine.stats.prefix_cache_queries == 0
        pool_is_whole(llm)
    assert outs[True] == outs[False] == [pair.plain(p, 20) for p in prompts]
    assert taus[True] == taus[False]


@pytest.mark.parametrize("spec,block_size,budget", SPECS)
def test_generated_pages_serve_the_next_turn(zoo, spec, block_size, budget):
    """A follow-up whose prompt is the last prompt and its answer finds the answer's pages too
    (generated, not prefilled), and still gives plain decoding's tokens."""
    pair = zoo("llama")
    next_turn_reuses_generated_pages(pair, spec, block_size, budget)


@pytest.mark.parametrize("spec,block_size,budget", SPECS)
def test_preemption_recomputes_the_same_tokens(zoo, spec, block_size, budget):
    """A pool of 40 pages of 4 tokens for three rows of up to ~90 positions: requests are
    preempted (pages freed, queued first, prompt and output recomputed) and still give plain
    decoding's tokens; the pool is whole afterwards."""
    pair = zoo("llama")
    prompts = make_prompts(pair.vocab, lens=(30, 25, 12, 28, 20), seed=6)
    max_tokens = [40, 40, 35, 40, 30]
    gb = pool_gb(pair, spec, block_size, budget, pages=40, page_size=4)
    llm = make_llm(pair, spec, block_size, budget, page_size=4, kv_cache_memory_gb=gb)
    assert llm.engine.pool.num_pages == 40
    outs = llm.generate(prompts, [greedy(n) for n in max_tokens])
    assert llm.engine.stats.preemptions > 0
    for p, n, out in zip(prompts, max_tokens, outs):
        assert out.token_ids == pair.plain(p, n), len(p)
    pool_is_whole(llm)


@pytest.mark.parametrize("overlap", [False, True])
def test_preemption_of_sampled_requests_with_rounds_in_flight(zoo, overlap):
    """Preempted sampled requests resume with their last token as the bonus (not sampled again)
    and give the seeded plain tokens, also while a round is in flight when pages run short."""
    pair = zoo("qwen3")
    prompts = make_prompts(pair.vocab, lens=(30, 25, 12, 28), seed=9)
    params = [SamplingParams(temperature=1.0, seed=3 + i, max_tokens=40, ignore_eos=True) for i in range(4)]
    want = [o.token_ids for o in make_llm(pair, "none", None, None, max_num_seqs=1).generate(prompts, params)]
    gb = pool_gb(pair, "ddtree", 4, 8, pages=40, page_size=4)
    llm = make_llm(pair, "ddtree", 4, 8, page_size=4, kv_cache_memory_gb=gb, overlap=overlap)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert llm.engine.stats.preemptions > 0
    pool_is_whole(llm)


@pytest.mark.parametrize("spec,block_size,budget", [SPECS[0], SPECS[2]])
def test_abort_frees_pages(zoo, spec, block_size, budget):
    """Aborting requests that wait, prefill or run frees everything they held."""
    pair = zoo("llama")
    llm = make_llm(pair, spec, block_size, budget, page_size=4, prefill_chunk=8)
    e = llm.engine
    prompts = make_prompts(pair.vocab, lens=(5, 30, 6, 7, 9), seed=7)
    seqs = [e.add_request(p, greedy(40)) for p in prompts]
    for _ in range(3):
        e.step()
    states = {s.status.value for s in seqs}
    assert {"running", "waiting"} <= states, states
    for s in seqs:
        e.abort(s)
        assert s.finish_reason == "abort"
    e.step()
    pool_is_whole(llm)
    # the engine serves on afterwards
    assert llm.generate([prompts[0]], greedy(12))[0].token_ids == pair.plain(prompts[0], 12)


def test_long_prompt_prefills_in_chunks_between_rounds(zoo):
    """A 100-token prompt with prefill_chunk 8 arrives while a request decodes: that request
    gets tokens every step of the other's prefill (13 chunks), and both give plain tokens."""
    pair = zoo("llama")
    short, long = make_prompts(pair.vocab, lens=(4, 100), seed=8)
    llm = make_llm(pair, "none", None, None, page_size=4, prefill_chunk=8, max_model_len=160)
    e = llm.engine
    a = e.add_request(short, greedy(40))
    e.step()
    b = e.add_request(long, greedy(10))
    steps = 0
    while not b.output_ids:
        got = dict((s.request_id, t) for s, t in e.step())
        assert got.get(a.request_id), "the running request stalled behind a prefill"
        steps += 1
    assert steps >= 100 // 8
    while e.has_unfinished():
        e.step()
    assert a.output_ids == pair.plain(short, 40) and b.output_ids == pair.plain(long, 10)
    pool_is_whole(llm)


def test_requests_beyond_the_context_are_refused_or_cut(zoo):
    """On a small pool the context shrinks to fit it: a longer prompt is refused at once, naming
    the limit; a prompt whose max_tokens reach past it ends with finish reason "length"."""
    pair = zoo("llama")
    gb = pool_gb(pair, "none", None, None, pages=9, page_size=4)
    llm = make_llm(pair, "none", None, None, page_size=4, kv_cache_memory_gb=gb)
    e = llm.engine
    assert e.max_model_len == 8 * 4 - 1   # the pool's 8 usable pages, less a decode's headroom
    with pytest.raises(ValueError, match="the context holds 31"):
        e.add_request(list(range(5)) * 7, greedy(1))
    with pytest.raises(ValueError, match="lower max_tokens to at most 28"):
        llm.generate([[1, 2, 3]], greedy(100))       # LLM refuses what the engine would cut
    (out,) = llm.generate([[1, 2, 3]], greedy(None))
    assert out.finish_reason == "length" and len(out.token_ids) == 31 - 3
    seq = e.add_request([1, 2, 3], greedy(100))      # the engine itself cuts at the context's end
    while e.has_unfinished():
        e.step()
    assert seq.output_ids == out.token_ids and seq.finish_reason == "length"
    pool_is_whole(llm)


def test_a_request_the_pool_can_never_hold_is_refused():
    cache = CacheConfig(max_num_seqs=2, max_model_len=100, headroom=1, page_size=4, num_pages=5)
    sched = Scheduler(SchedulerConfig(cache, 1, 64, 256, 1), PagePool(5, 4), rows=None)
    with pytest.raises(ValueError, match="needs 16 KV pages .* the pool has 4"):
        sched.add(Sequence(list(range(10)), SamplingParams(max_tokens=50)))
    sched.add(Sequence(list(range(10)), SamplingParams(max_tokens=4)))
    assert len(sched.waiting) == 1


def test_page_pool_refcounts_and_lru_eviction():
    pool = PagePool(6, 2)
    ids = [1, 2, 3, 4, 5, 6]
    a = pool.allocate(3)
    assert a is not None and 0 not in a and pool.num_free == 2
    assert pool.allocate(3) is None and pool.num_free == 2       # all or nothing
    pool.register(ids, a, 0, 3)
    assert pool.match(ids, 3) == a and pool.ref[a[0]] == 2       # shared
    pool.free(a)
    pool.free(a)
    assert pool.num_free == 5                                    # cached pages count as free
    assert pool.match(ids[:4] + [9, 9], 3) == a[:2]              # the prefix up to the first difference
    pool.free(a[:2])
    fresh = pool.allocate(2)                                     # fresh pages before cached ones
    assert set(fresh).isdisjoint(a)
    pool.allocate(1)            # evicts the least recently freed: the prefix's tail, freed first
    assert pool.match(ids, 3) == a[:2]
    pool.free(a[:2])
    pool.allocate(2)
    assert pool.match(ids, 3) == []
    pool2 = PagePool(4, 2, prefix_caching=False)
    b = pool2.allocate(2)
    pool2.register(ids, b, 0, 2)
    assert pool2.match(ids, 2) == []


def test_memory_flags_are_checked(zoo):
    pair = zoo("llama")
    with pytest.raises(ValueError, match="on cpu give kv_cache_memory_gb"):
        make_llm(pair, "none", None, None, gpu_memory_utilization=0.5)
    with pytest.raises(ValueError, match="not both"):
        make_llm(pair, "none", None, None, gpu_memory_utilization=0.5, kv_cache_memory_gb=0.01)
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        make_llm(pair, "none", None, None, page_size=0)
    with pytest.raises(ValueError, match="prefill_chunk must be >= 1"):
        make_llm(pair, "none", None, None, prefill_chunk=0)
