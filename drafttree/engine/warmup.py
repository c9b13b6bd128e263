"""Warm-up before serving: run once every path a request can take that is not a CUDA graph, so
that no request pays for a first call: the sampler's compiled pieces per sample mode (at one row
and at several: torch.compile specializes on 1), and eager prefill: a chunk wider than the
largest graph, at position 0 and at an offset (continuing a prompt longer than `prefill_chunk`),
and, for prefills without graphs (none captured, or a capture out of memory), chunks at offsets
(a continuing chunk, the rest of a prompt after a prefix-cache hit); each with a chunk of 1 token,
of a multiple of 16 and of neither, the integer cases Triton specializes on; and the host's
reading and detokenizing. With prefill graphs the chunks at offsets replay the offset graphs (the
same batches then run the host's side of them); a processed request (log-probabilities) and a
constrained one (a JSON object; with a tokenizer), whose rounds run eagerly where their graphs are
left for later, and whose grammar engine is built at the first such request. The graphs
themselves are captured when the engine is built. On CPU there is nothing to compile: one short
request, and a constrained one. What the requests taught the budget choice is forgotten after
them: their prompts are not the traffic's."""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from drafttree.engine.engine import Engine
from drafttree.runner.prefill_plan import PrefillLimits
from drafttree.sampling import SamplingParams
from drafttree.settings import scope
from drafttree.structured.params import StructuredOutputs

log = logging.getLogger(__name__)

WARMUP_TOKENS = 4   # per request: the prefill's token and a few rounds
MODES = (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=0),
         SamplingParams(temperature=1.0, top_p=0.9, seed=0))   # greedy, sampled, sampled with top-p
PROCESSED = SamplingParams(temperature=0.0, logprobs=1)
CONSTRAINED = SamplingParams(temperature=0.0, structured_outputs=StructuredOutputs(json_object=True))


@dataclass(frozen=True)
class WarmupBatch:
    prompt_lens: tuple[int, ...]   # added together, prefilled in the steps the scheduler gives them
    params: SamplingParams
    variants: tuple[int, ...]      # per prompt: prompts of one variant are prefixes of one token
                                   # sequence (a later one finds the earlier one's pages cached)


def warmup_batches(cuda: bool, limits: PrefillLimits, graphed_len: int, page_size: int,
                   prefix_caching: bool, max_prompt_len: int | None = None,
                   constrained: bool = False) -> list[WarmupBatch]:
    """What `warm_up` runs, batch after batch. `graphed_len`: the widest chunk a prefill graph
    takes (0: none); `max_prompt_len`: the longest prompt the context and the pool hold;
    `constrained`: a constrained request too (the engine has a tokenizer)."""
    longest = limits.max_prompt_len if max_prompt_len is None else max(1, min(max_prompt_len, limits.max_prompt_len))
    count = [0]

    def batch(params: SamplingParams, *lens: int, variant: int | None = None) -> WarmupBatch:
        lens = tuple(min(n, longest) for n in lens)
        if variant is None:
            variants = tuple(range(count[0], count[0] + len(lens)))
            count[0] += len(lens)
        else:
            variants = (variant,) * len(lens)
        return WarmupBatch(lens, replace(params, max_tokens=WARMUP_TOKENS if cuda else 2), variants)

    if not cuda:
        return [batch(MODES[0], 7)] + ([batch(CONSTRAINED, 7)] if constrained else [])
    rows = limits.max_num_seqs
    out = []
    for mode in MODES + (PROCESSED,) + ((CONSTRAINED,) if constrained else ()):
        out.append(batch(mode, 7))
        if rows >= 2:
            out.append(batch(mode, 16, 7))
    greedy = MODES[0]
    # eager at position 0 past the graphs; a chunk continuing at an offset past prefill_chunk
    # (graphed up to graphed_len, eager past it)
    bases = (graphed_len, limits.prefill_chunk,
             limits.prefill_chunk + graphed_len if 0 < graphed_len < limits.prefill_chunk else 0)
    wide = [base + d for base in bases if base for d in (1, 2, 16)]
    for n in dict.fromkeys(n for n in wide if n <= longest):
        out.append(batch(greedy, n))
    odd = (graphed_len or limits.prefill_chunk) + 1
    if rows >= 2 and odd <= longest:
        out.append(batch(greedy, odd, odd))
    # a prefix-cache hit: the rest of a prompt at an offset of whole pages
    first = min(3 * page_size, longest)
    if prefix_caching and first > page_size:
        v = count[0]
        count[0] += 1
        out.append(batch(greedy, first, variant=v))
        hit = (first - 1) // page_size * page_size   # the positions the first prompt left cached
        again = list(dict.fromkeys((hit + 1, hit + 2, first)))
        out += [batch(greedy, n, variant=v) for n in again]
        if rows >= 2 and limits.fits(2, first - hit):
            out.append(batch(greedy, hit + 1, hit + 2, variant=v))
    return out


def warm_up(engine: Engine, progress: Callable[[str], None] | None = None) -> int:
    """Run the warm-up requests to the end, then clear the engine's counters so that what it
    reports counts requests only. Returns the number of warm-up requests. The engine must be idle.
    `progress(text)` hears of each batch as it starts."""
    assert not engine.has_unfinished(), "warm-up needs an idle engine"
    with scope(engine.settings):   # what it compiles and loads, it does for the engine's kernels
        return _warm_up(engine, progress)


def _warm_up(engine: Engine, progress: Callable[[str], None] | None) -> int:
    runner, sched = engine.runner, engine.scheduler
    graphed = 0 if runner.prefill_graphs is None else runner.prefill_graphs.widest()
    cc = runner.cache_cfg
    # a warm-up request must fit the pool alone: its prompt, its tokens and a round's writes
    room = engine.pool.usable * cc.page_size - cc.headroom - engine.spec.max_commit - WARMUP_TOKENS
    batches = warmup_batches(engine.device.type == "cuda", sched.cfg.prefill, graphed, cc.page_size,
                             engine.pool.prefix_caching, room, engine.tokenizer is not None)
    vocab = engine.model_cfg.vocab_size
    for i, b in enumerate(batches):
        if progress is not None:
            progress(f"batch {i + 1}/{len(batches)}: prompts of {', '.join(map(str, b.prompt_lens))} tokens")
        for n, v in zip(b.prompt_lens, b.variants):
            engine.add_request([1 + (i + 13 * v) % (vocab - 1) for i in range(n)], replace(b.params))
        while engine.has_unfinished():
            engine.step()
    stats = engine.stats
    fallbacks = stats.graph_fallbacks + stats.prefill_fallbacks
    if fallbacks:
        log.warning("warm-up: %d rounds or prefills ran eagerly although graphs were captured", fallbacks)
    engine.reset_stats()
    engine.reset_choice()
    return sum(len(b.prompt_lens) for b in batches)
