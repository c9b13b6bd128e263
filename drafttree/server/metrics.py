"""Prometheus metrics of one server, kept in their own registry and fed from the engine thread."""
from __future__ import annotations

import copy

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Summary,
    generate_latest,
)

from drafttree.engine.engine import Engine, EngineStats

CONTENT_TYPE = CONTENT_TYPE_LATEST
ACCEPT_BUCKETS = tuple(float(i) for i in range(1, 17))


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.requests = Counter("drafttree_requests", "Requests admitted by the engine", registry=r)
        self.finished = Counter("drafttree_requests_finished", "Requests finished, by reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("drafttree_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generated_tokens = Counter("drafttree_generation_tokens", "Tokens generated", registry=r)
        self.rounds = Counter("drafttree_rounds", "Decoding rounds (one per engine step)", registry=r)
        self.fallbacks = Counter("drafttree_cuda_graph_fallbacks",
                                 "Rounds that ran eagerly although CUDA graphs were captured", registry=r)
        self.accept_length = Histogram("drafttree_accept_length",
                                       "Tokens committed per request per round (tau, bonus included)",
                                       buckets=ACCEPT_BUCKETS, registry=r)
        self.prefill_seconds = Counter("drafttree_prefill_seconds", "Seconds spent in prefill", registry=r)
        self.round_seconds = Counter("drafttree_round_seconds", "Seconds spent in decoding rounds", registry=r)
        self.round_duration = Summary("drafttree_round_duration_seconds", "Duration of one decoding round",
                                      registry=r)
        self.phase_seconds = Counter("drafttree_phase_seconds", "Seconds spent per phase (prefill, decode, "
                                     "draft incl. tree build, verify incl. acceptance and commit)", ["phase"],
                                     registry=r)
        self.running = Gauge("drafttree_requests_running", "Requests holding KV pages (running or prefilling)",
                             registry=r)
        self.waiting = Gauge("drafttree_requests_waiting", "Requests queued for KV pages", registry=r)
        self.prefix_queries = Counter("drafttree_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter("drafttree_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                   registry=r)
        self.prefix_hit_rate = Gauge("drafttree_prefix_cache_hit_rate", "Prefix cache hits / queries, in tokens",
                                     registry=r)
        self.preemptions = Counter("drafttree_preemptions", "Requests preempted (pages freed, recomputed later)",
                                   registry=r)
        self.free_pages = Gauge("drafttree_kv_free_pages", "KV pages free (cached prefix pages included)", registry=r)
        self._seen = EngineStats()         # engine totals already exported
        self._seen_fallbacks = 0
        self._seen_phases: dict[str, float] = {}

    def sync(self, engine: Engine) -> None:
        """Export what the engine counted since the last sync. Call on the engine thread only."""
        s, seen = engine.stats, self._seen
        self.requests.inc(s.requests - seen.requests)
        self.prompt_tokens.inc(s.prompt_tokens - seen.prompt_tokens)
        self.generated_tokens.inc(s.generated_tokens - seen.generated_tokens)
        new_rounds = s.rounds - seen.rounds
        self.rounds.inc(new_rounds)
        for k, count in s.accept_hist.items():
            for _ in range(count - seen.accept_hist.get(k, 0)):
                self.accept_length.observe(k)
        self.prefill_seconds.inc(max(s.prefill_seconds - seen.prefill_seconds, 0.0))
        spent = max(s.round_seconds - seen.round_seconds, 0.0)
        self.round_seconds.inc(spent)
        if new_rounds:
            for _ in range(new_rounds):
                self.round_duration.observe(spent / new_rounds)
        graphs = getattr(engine.runner, "graphs", None)
        fallbacks = int(graphs.fallbacks) if graphs is not None else 0
        self.fallbacks.inc(max(fallbacks - self._seen_fallbacks, 0))
        phases = dict(engine.runner.timer.totals)
        for name, total in phases.items():
            self.phase_seconds.labels(phase=name).inc(max(total - self._seen_phases.get(name, 0.0), 0.0))
        self.running.set(len(engine.running))
        self.waiting.set(len(engine.waiting))
        self.prefix_queries.inc(s.prefix_cache_queries - seen.prefix_cache_queries)
        self.prefix_hits.inc(s.prefix_cache_hits - seen.prefix_cache_hits)
        self.prefix_hit_rate.set(s.prefix_cache_hit_rate)
        self.preemptions.inc(s.preemptions - seen.preemptions)
        self.free_pages.set(engine.free_pages)
        self._seen = copy.deepcopy(s)
        self._seen_fallbacks, self._seen_phases = fallbacks, phases

    def request_finished(self, reason: str | None) -> None:
        self.finished.labels(finish_reason=reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
