"""Warm-up before serving: run once every path a request can take that is not a CUDA graph, so
that no request pays for a first call: the sampler's compiled pieces per sample mode (at one row
and at several: torch.compile specializes on 1), eager prefill (prompts longer than the largest
graphed length: lengths, and chunk remainders past prefill_chunk, of 1, of a multiple of 16 and of
neither, the integer cases Triton specializes on), and the host's reading and detokenizing. The graphs themselves are captured when the
engine is built. On CPU there is nothing to compile: one short request."""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from drafttree.engine.engine import Engine, EngineStats
from drafttree.runner.prefill_graph import prefill_fits
from drafttree.sampling import SamplingParams

log = logging.getLogger(__name__)

WARMUP_TOKENS = 4   # per request: the prefill's token and a few rounds
MODES = (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=0),
         SamplingParams(temperature=1.0, top_p=0.9, seed=0))   # greedy, sampled, sampled with top-p


@dataclass(frozen=True)
class WarmupBatch:
    prompt_lens: tuple[int, ...]   # prefilled together when they fit one prefill
    params: SamplingParams


def warmup_batches(cuda: bool, max_num_seqs: int, max_prompt_len: int, max_prefill_tokens: int,
                   graphed_len: int) -> list[WarmupBatch]:
    """What `warm_up` runs. `graphed_len`: the longest prompt a prefill graph takes (0: none)."""
    def lens(*ns: int) -> tuple[int, ...]:
        return tuple(min(n, max_prompt_len) for n in ns)

    if not cuda:
        return [WarmupBatch(lens(7), replace(MODES[0], max_tokens=2))]
    out = []
    for mode in MODES:
        p = replace(mode, max_tokens=WARMUP_TOKENS)
        out.append(WarmupBatch(lens(7), p))
        if max_num_seqs >= 2:
            out.append(WarmupBatch(lens(16, 7), p))
    if graphed_len and max_prompt_len > graphed_len:
        greedy = replace(MODES[0], max_tokens=WARMUP_TOKENS)
        odd = graphed_len + 1
        for n in (odd, graphed_len + 2, graphed_len + 16):
            if n <= max_prompt_len:
                out.append(WarmupBatch((n,), greedy))
        if max_num_seqs >= 2 and prefill_fits(2, odd, max_prefill_tokens):
            out.append(WarmupBatch(lens(odd, odd), greedy))
    return out


def warm_up(engine: Engine) -> int:
    """Run the warm-up requests to the end, then clear the engine's counters so that what it
    reports counts requests only. Returns the number of warm-up requests. The engine must be idle."""
    assert not engine.has_unfinished(), "warm-up needs an idle engine"
    runner = engine.runner
    pg = runner.prefill_graphs
    graphed = 0 if pg is None or pg.failed or not pg.graphs else max(Pb for _, Pb in pg.graphs)
    batches = warmup_batches(engine.device.type == "cuda", runner.cache_cfg.max_num_seqs,
                             engine.max_model_len - 1, engine.cfg.max_prefill_tokens, graphed)
    vocab = engine.model_cfg.vocab_size
    for batch in batches:
        for n in batch.prompt_lens:
            engine.add_request([1 + i % (vocab - 1) for i in range(n)], replace(batch.params))
        while engine.has_unfinished():
            engine.step()
    fallbacks = (runner.graphs.fallbacks if runner.graphs is not None else 0) + (pg.fallbacks if pg else 0)
    if fallbacks:
        log.warning("warm-up: %d rounds or prefills ran eagerly although graphs were captured", fallbacks)
    engine.stats = EngineStats()
    runner.timer.reset()
    if runner.graphs is not None:
        runner.graphs.fallbacks = 0
    if pg is not None:
        pg.fallbacks = 0
    return sum(len(b.prompt_lens) for b in batches)
