"""An engine's counters, with one owner: the loop counts into `Stats.counts`; `collect()` gives a
snapshot of everything counted (the loop's counts with the prefix cache's, the scheduler's
preemptions, the runner's seconds per phase and graph fallbacks), `reset()` zeroes all of them.
The server's metrics, the benchmarks and the warm-up use these two and nothing else."""
from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass, field

from drafttree.engine.pages import PagePool, PrefixStats
from drafttree.engine.scheduler import Scheduler
from drafttree.runner.model_runner import ModelRunner


@dataclass
class EngineStats:
    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    rounds: int = 0
    accept_hist: Counter = field(default_factory=Counter)   # τ -> rounds (bounded, unlike a list)
    round_seconds: float = 0.0
    prefill_seconds: float = 0.0
    budget_hist: Counter = field(default_factory=Counter)    # chosen budget -> rounds (0: decode)
    method_rounds: Counter = field(default_factory=Counter)  # decode | dflash | ddtree -> rounds
    method_rows: Counter = field(default_factory=Counter)    # ... -> request-rounds
    method_tokens: Counter = field(default_factory=Counter)  # ... -> tokens committed (Σ τ)
    plain_rounds: Counter = field(default_factory=Counter)   # why a speculative engine's rounds decoded
                                                             # plainly -> rounds (engine._plain_reason)
    spec_accept_hist: Counter = field(default_factory=Counter)   # τ -> request-rounds that verified drafts
    draft_tokens: int = 0           # draft tokens verified: Σ over those request-rounds of the round's budget
    prefix_cache_queries: int = 0   # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0      # of those, found there (not computed again)
    preemptions: int = 0
    phase_seconds: dict[str, float] = field(default_factory=dict)   # prefill, context, decode, draft, verify
    graph_fallbacks: int = 0        # rounds run eagerly although graphs were captured
    prefill_fallbacks: int = 0      # graphable prefills run eagerly (their shape not captured)
    graph_stand_ins: int = 0        # rounds that replayed another set's graphs, theirs still to come

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class Stats:
    def __init__(self, pool: PagePool, scheduler: Scheduler, runner: ModelRunner) -> None:
        self.pool, self.scheduler, self.runner = pool, scheduler, runner
        self.counts = EngineStats()   # what the engine's loop counts itself

    def collect(self) -> EngineStats:
        """A snapshot of every counter (a copy: later steps do not change it)."""
        out = copy.deepcopy(self.counts)
        out.prefix_cache_queries, out.prefix_cache_hits = self.pool.stats.queries, self.pool.stats.hits
        out.preemptions = self.scheduler.preemptions
        r = self.runner.counters()
        out.phase_seconds, out.graph_fallbacks, out.prefill_fallbacks = r.phase_seconds, r.graph_fallbacks, \
            r.prefill_fallbacks
        out.graph_stand_ins = r.graph_stand_ins
        return out

    def reset(self) -> None:
        self.counts = EngineStats()
        self.pool.stats = PrefixStats()
        self.scheduler.preemptions = 0
        self.runner.reset_counters()
