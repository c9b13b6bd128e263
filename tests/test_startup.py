"""Start-up, weight-free: the prefill graphs captured are exactly the shapes the scheduler's
forwards can ask for, and the warm-up plan covers the paths graphs do not."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from drafttree.engine.pages import PagePool
from drafttree.engine.scheduler import Scheduler, SchedulerConfig
from drafttree.engine.sequence import Sequence
from drafttree.engine.warmup import warmup_batches
from drafttree.runner.model_runner import CacheConfig
from drafttree.runner.prefill_plan import MIN_LEN, PrefillLimits, reach
from drafttree.sampling import SampleMode, SamplingParams

HEADROOM, MAX_COMMIT = 9, 5


def scheduler(rows: int, max_prefill: int, max_model_len: int, chunk: int, page_size: int,
              pages: int, prefix_caching: bool = True) -> Scheduler:
    cache = CacheConfig(rows, max_model_len, HEADROOM, page_size, pages)
    cfg = SchedulerConfig(cache, MAX_COMMIT, chunk, max_prefill, admit_min=1)
    return Scheduler(cfg, PagePool(pages, page_size, prefix_caching), SimpleNamespace(move_row=lambda s, d: None))


def kv_buckets(max_len: int) -> tuple[int, ...]:
    """The rounds' KV-length buckets of a cache of max_len positions."""
    return tuple(CacheConfig(1, max_len - HEADROOM, HEADROOM).kv_buckets)


def forwards(sched: Scheduler, prompts: list[list[int]], rng: random.Random | None = None,
             steps: int = 1) -> list[tuple[int, int, int]]:
    """(chunks, width, reach) of each prefill forward the real scheduler forms for `prompts` over
    `steps` steps (reach: max(start + len) when a chunk starts at an offset, else 0, as
    ModelRunner.prefill finds it); with `rng`, a random share of the running requests ends after
    each step, freeing rows and pages."""
    for ids in prompts:
        sched.add(Sequence(ids, SamplingParams(max_tokens=1)))
    out = []
    for _ in range(steps):
        chunks = sched.schedule_prefill()
        if chunks:
            spans = [(c.start, len(c.ids)) for _, c in chunks]
            out.append((len(chunks), max(n for _, n in spans), reach(spans)))
            sched.prefilled(chunks)
        for seq in list(sched.running):
            if rng is None or rng.random() < 0.5:
                sched.free(seq)
        if not (sched.waiting or sched.prefilling):
            break
    return out


def hit_forwards(sched: Scheduler, fresh, W: int, k: int, reach_above: int, reach_most: int) -> list:
    """A prompt whose first pages are cached and whose rest (W tokens, or a step's worth) ends
    past `reach_above` and by `reach_most`, with k one-token prompts: the forwards (first the one
    caching the pages). [] if no page-aligned prefix fits."""
    ps = sched.pool.page_size
    s = max(ps, -(-(reach_above + 1 - W) // ps) * ps)
    if s + W > reach_most:
        return []
    common = [next(fresh) for _ in range(s + 1)]
    out = forwards(sched, [common], steps=10**6)
    return out + forwards(sched, [common[:s] + [next(fresh) for _ in range(W)]] + [[next(fresh)] for _ in range(k)])


CASES = [   # max_num_seqs, max_prefill_tokens, max_model_len, prefill_chunk, page size
    (4, 8192, 300, 2048, 16),
    (8, 100, 200, 64, 16),
    (3, 40, 40, 2048, 4),
    (6, 8192, 20, 16, 4),
    (5, 70, 129, 128, 16),
    (40, 8192, 80, 256, 16),
    (2, 8192, 1100, 512, 16),     # KV buckets 1024 and 1109: offsets at either
    (2, 600, 1024, 2048, 16),     # KV buckets 1024 and 1033: no prompt reaches past 1024
]


@pytest.mark.parametrize("rows,max_prefill,max_model_len,chunk,page_size", CASES)
def test_prefill_shapes_are_exactly_what_the_scheduler_asks(rows, max_prefill, max_model_len, chunk, page_size):
    """Queues that reach every (chunks, width, reach bucket) a step's forward can have (a prompt
    of each length, from position 0 and after a prefix-cache hit ending in each KV bucket,
    followed by one-token prompts), and random traffic with shared prefixes and continuing
    chunks, go through the real scheduler; the graphs their forwards replay, from position 0 and
    at offsets, are the set captured at start-up, no more and no fewer."""
    pages = 1 + (rows + 2) * -(-(max_model_len + HEADROOM + MAX_COMMIT) // page_size)
    fresh = iter(range(1, 10**9))
    limits = scheduler(rows, max_prefill, max_model_len, chunk, page_size, pages).cfg.prefill
    bounds = list(zip([0] + list(limits.kv_buckets), limits.kv_buckets))
    seen = []
    for W in range(1, max_model_len):
        for k in range(rows):
            prompts = [[next(fresh) for _ in range(W)]] + [[next(fresh)] for _ in range(k)]
            seen += forwards(scheduler(rows, max_prefill, max_model_len, chunk, page_size, pages), prompts)
            if limits.length_bucket(min(W, chunk)) is None:
                continue
            for above, most in bounds:
                sched = scheduler(rows, max_prefill, max_model_len, chunk, page_size, pages)
                seen += hit_forwards(sched, fresh, W, k, above, min(most, max_model_len - 1))
    rng = random.Random(0)
    for _ in range(30):
        sched = scheduler(rows, max_prefill, max_model_len, chunk, page_size, 4 * pages)
        common = [next(fresh) for _ in range(max_model_len)]
        prompts = []
        for _ in range(3 * rows):
            ids = common if rng.random() < 0.3 else [next(fresh) for _ in range(max_model_len)]
            prompts.append(ids[:rng.randint(1, max_model_len - 1)])
        seen += forwards(sched, prompts, rng, steps=10 * len(prompts))
    asked: set[tuple[int, int, int]] = set()
    for n, W, to in seen:
        assert limits.fits(n, W) and n <= limits.most_chunks(W)
        asked.update(g.shape for g in limits.groups(n, W, to) or ())
    assert any(to for _, _, to in seen)
    captured = limits.shapes()
    assert len(captured) == len(set(captured))
    assert set(captured) == asked
    tokens = limits.graph_tokens
    assert all(MIN_LEN <= Pb <= min(tokens, limits.max_len) and n * Pb <= max(tokens, Pb) for n, Pb, _ in captured)
    assert all(L == 0 or Pb <= L <= limits.max_len and L in limits.kv_buckets for _, Pb, L in captured)
    assert {L for _, _, L in captured} == {0, *limits.offset_lengths()}


def test_prefill_groups_split_by_graphed_tokens_and_pad_rows_to_powers_of_two():
    lim = PrefillLimits(8, 1024, 8192, 4000, 4096, (1024, 4096))
    assert [(g.first, g.count, g.shape) for g in lim.groups(5, 300)] == [(0, 2, (2, 512, 0)), (2, 2, (2, 512, 0)),
                                                                        (4, 1, (1, 512, 0))]
    assert [g.shape for g in lim.groups(5, 100)] == [(8, 128, 0)]    # 5 chunks in the graph of 8 rows
    assert [g.shape for g in lim.groups(1, 3)] == [(1, 16, 0)]
    assert lim.groups(1, 1025) is None                               # wider than any graph: eager
    odd = PrefillLimits(256, 1000, 8192, 4000, 4096, (1024, 4096))   # 62 chunks of 16 per graph
    assert [g.shape for g in odd.groups(70, 9)] == [(62, 16, 0), (8, 16, 0)]
    # at an offset: the smallest KV bucket that holds the forward's reach, for every group
    assert [g.shape for g in lim.groups(1, 3, reach=40)] == [(1, 16, 1024)]
    assert [g.shape for g in lim.groups(1, 1000, reach=1024)] == [(1, 1024, 1024)]
    assert [g.shape for g in lim.groups(5, 300, reach=1025)] == [(2, 512, 4096), (2, 512, 4096), (1, 512, 4096)]
    assert lim.groups(1, 1025, reach=3000) is None
    with pytest.raises(ValueError, match="past the cache"):
        lim.groups(1, 3, reach=4097)
    with pytest.raises(ValueError, match="kv_buckets"):
        PrefillLimits(8, 1024, 8192, 4000, 4096, (1024,))


def test_prefill_shapes_at_the_default_settings():
    """max_num_seqs 256, prefill_chunk 2048, max_prefill_tokens 8192, the default model's context
    (8,192; KV buckets 1,024, 4,096 and 8,224): 36 graphs from position 0 (one per chunk count
    would be 255), and the same (rows, length) at each bucket that holds the length: 143."""
    shapes = PrefillLimits(256, 2048, 8192, 8191, 8224, (1024, 4096, 8224)).shapes()
    per_len = {}
    for n, Pb, L in shapes:
        per_len.setdefault((Pb, L), []).append(n)
    assert len(shapes) == 143 and sum(L == 0 for _, _, L in shapes) == 36
    assert {Pb: max(ns) for (Pb, L), ns in per_len.items() if L == 0} == {16 << i: 128 >> i for i in range(8)}
    assert all(sorted(ns) == [1 << i for i in range(len(ns))] for ns in per_len.values())
    assert all(per_len[(Pb, L)] == per_len[(Pb, 0)] for Pb, L in per_len)
    assert {L for _, Pb, L in shapes if Pb == 2048} == {0, 4096, 8224}
    assert {L for _, Pb, L in shapes if Pb == 1024} == {0, 1024, 4096, 8224}
    assert shapes[0] == (1, 2048, 8224)   # the largest first: captures share one memory pool
    # a long context: buckets up to 32,800, the same (rows, length) set at each
    assert len(PrefillLimits(256, 2048, 8192, 32767, 32800, (1024, 4096, 16384, 32800)).shapes()) == 36 + 35 * 4 + 3


def test_scheduler_and_graphs_share_one_rule():
    sched = scheduler(6, 8192, 20, 16, 4, 64)
    lim = sched.cfg.prefill
    assert (lim.max_num_seqs, lim.prefill_chunk, lim.max_prefill_tokens, lim.max_prompt_len) == (6, 16, 8192, 19)
    assert sched.cfg.prefill is lim


def plan(**kw):
    kw = {"cuda": True, "graphed_len": 2048, "page_size": 16, "prefix_caching": True, **kw}
    return warmup_batches(kw.pop("cuda"), kw.pop("limits"), kw.pop("graphed_len"), kw.pop("page_size"),
                          kw.pop("prefix_caching"), kw.pop("max_prompt_len", None), kw.pop("constrained", False))


def test_warmup_plan_covers_modes_rows_offsets_and_prefix_hits():
    batches = plan(limits=PrefillLimits(8, 2048, 8192, 3999, 4100, kv_buckets(4100)))
    seen = {(SampleMode.of([b.params]), len(b.prompt_lens)) for b in batches}
    assert seen >= {(m, n) for m in SampleMode for n in (1, 2)}
    assert {len(b.prompt_lens) for b in batches if b.params.processes_logits} == {1, 2}
    assert not any(b.params.structured_outputs for b in batches)   # no tokenizer, no constrained request
    with_grammar = plan(limits=PrefillLimits(8, 2048, 8192, 3999, 4100, kv_buckets(4100)), constrained=True)
    assert {len(b.prompt_lens) for b in with_grammar if b.params.structured_outputs} == {1, 2}
    past = sorted(n for b in batches for n in b.prompt_lens if n > 2048)
    assert {(n - 2048) % 16 for n in past} >= {0, 1, 2}   # the chunk past 2048 at an offset: 1, 2, 16 tokens
    assert any(len(b.prompt_lens) == 2 and min(b.prompt_lens) > 2048 for b in batches)
    # a variant's first prompt, then prompts of it again: the rest past its cached pages, at 1, 2 and 16 tokens
    first: dict[int, int] = {}
    rests = set()
    for b in batches:
        for n, v in zip(b.prompt_lens, b.variants):
            if v in first:
                rests.add(n - (first[v] - 1) // 16 * 16)
            else:
                first[v] = n
    assert rests == {1, 2, 16}
    assert any(len(b.prompt_lens) == 2 and len(set(b.variants)) == 1 for b in batches)
    assert all(b.params.max_tokens >= 2 for b in batches)
    no_cache = plan(limits=PrefillLimits(8, 2048, 8192, 3999, 4100, kv_buckets(4100)), prefix_caching=False)
    assert all(len(set(b.variants)) == len(b.variants) for b in no_cache)
    assert len({v for b in no_cache for v in b.variants}) == sum(len(b.variants) for b in no_cache)


def test_warmup_plan_stays_within_the_context_the_pool_and_rows():
    batches = plan(limits=PrefillLimits(1, 2048, 8192, 10, 50, kv_buckets(50)), graphed_len=16)
    assert all(len(b.prompt_lens) == 1 and max(b.prompt_lens) <= 10 for b in batches)
    assert {SampleMode.of([b.params]) for b in batches} == set(SampleMode)
    small_pool = plan(limits=PrefillLimits(4, 2048, 8192, 3999, 4100, kv_buckets(4100)), max_prompt_len=40)
    assert max(n for b in small_pool for n in b.prompt_lens) == 40
    cpu = plan(cuda=False, limits=PrefillLimits(8, 2048, 8192, 3999, 4100, kv_buckets(4100)), graphed_len=0)
    assert len(cpu) == 1 and len(cpu[0].prompt_lens) == 1   # a short dummy generate
    cpu = plan(cuda=False, limits=PrefillLimits(8, 2048, 8192, 3999, 4100, kv_buckets(4100)), graphed_len=0,
               constrained=True)
    assert [bool(b.params.structured_outputs) for b in cpu] == [False, True]   # and a constrained one


def test_ready_line_counts_prefill_graphs_from_zero_and_at_offsets():
    from drafttree.runner.model_runner import ModelRunner
    pg = SimpleNamespace(failed=False, graphs=dict.fromkeys([(1, 16, 0), (1, 16, 1024), (2, 16, 1024)]), pending=[])
    runner = SimpleNamespace(graphs=SimpleNamespace(graphs={0: None}), prefill_graphs=pg)
    assert ModelRunner.describe_graphs(runner) == "1 round graphs, 3 prefill graphs (1 from position 0, 2 at offsets)"
    pg.pending = [(4, 16, 0), (4, 16, 1024)]   # a server's, left for while idle
    assert ModelRunner.describe_graphs(runner) == \
        "1 round graphs, 3 prefill graphs (1 from position 0, 2 at offsets), 2 more later"
    pg.graphs = {}
    assert ModelRunner.describe_graphs(runner) == "1 round graphs, 2 prefill graphs later, while idle"
    pg.failed, pg.pending = True, []
    assert ModelRunner.describe_graphs(runner) == "1 round graphs, prefill eager"
