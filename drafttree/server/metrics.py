"""Prometheus metrics of one server, kept in their own registry and fed from the engine thread."""
from __future__ import annotations

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
BUDGET_BUCKETS = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0)


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
        self.prefill_fallbacks = Counter("drafttree_prefill_graph_fallbacks",
                                         "Graphable prefills that ran eagerly (their shape was not captured)",
                                         registry=r)
        self.accept_length = Histogram("drafttree_accept_length",
                                       "Tokens committed per request per round (tau, bonus included)",
                                       buckets=ACCEPT_BUCKETS, registry=r)
        self.round_budget = Histogram("drafttree_round_budget",
                                      "Draft nodes each round verified at (0: a plain decode round), as chosen",
                                      buckets=BUDGET_BUCKETS, registry=r)
        self.method_rounds = Counter("drafttree_method_rounds", "Rounds by what they ran (decode, dflash, ddtree)",
                                     ["method"], registry=r)
        self.method_request_rounds = Counter("drafttree_method_request_rounds",
                                             "Request-rounds by method (a round of B requests counts B)",
                                             ["method"], registry=r)
        self.method_tokens = Counter("drafttree_method_tokens",
                                     "Tokens committed by method; over request-rounds: that method's mean tau",
                                     ["method"], registry=r)
        self.prefill_seconds = Counter("drafttree_prefill_seconds", "Seconds spent in prefill", registry=r)
        self.round_seconds = Counter("drafttree_round_seconds", "Seconds spent in decoding rounds", registry=r)
        self.round_duration = Summary("drafttree_round_duration_seconds", "Duration of one decoding round",
                                      registry=r)
        self.phase_seconds = Counter("drafttree_phase_seconds", "Seconds spent per phase (prefill, decode, "
                                     "draft incl. tree build, verify incl. acceptance and commit)", ["phase"],
                                     registry=r)
        self.startup_seconds = Gauge("drafttree_startup_seconds", "Seconds each start-up stage took (convert, "
                                     "load weights, graphs per phase, prefill graphs, warm-up)", ["stage"],
                                     registry=r)
        self.startup_total = Gauge("drafttree_startup_total_seconds", "Seconds from start-up to ready", registry=r)
        self.ready = Gauge("drafttree_ready", "1 once warm-up is done and requests are served", registry=r)
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

    def sync(self, engine: Engine) -> None:
        """Export what the engine counted since the last sync (`Engine.stats`, a snapshot). Call on
        the engine thread only."""
        s, seen = engine.stats, self._seen
        self.requests.inc(s.requests - seen.requests)
        self.prompt_tokens.inc(s.prompt_tokens - seen.prompt_tokens)
        self.generated_tokens.inc(s.generated_tokens - seen.generated_tokens)
        new_rounds = s.rounds - seen.rounds
        self.rounds.inc(new_rounds)
        for k, count in s.accept_hist.items():
            for _ in range(count - seen.accept_hist.get(k, 0)):
                self.accept_length.observe(k)
        for k, count in s.budget_hist.items():
            for _ in range(count - seen.budget_hist.get(k, 0)):
                self.round_budget.observe(k)
        for counter, now, before in ((self.method_rounds, s.method_rounds, seen.method_rounds),
                                     (self.method_request_rounds, s.method_rows, seen.method_rows),
                                     (self.method_tokens, s.method_tokens, seen.method_tokens)):
            for method, n in now.items():
                counter.labels(method=method).inc(n - before.get(method, 0))
        self.prefill_seconds.inc(max(s.prefill_seconds - seen.prefill_seconds, 0.0))
        spent = max(s.round_seconds - seen.round_seconds, 0.0)
        self.round_seconds.inc(spent)
        if new_rounds:
            for _ in range(new_rounds):
                self.round_duration.observe(spent / new_rounds)
        self.fallbacks.inc(max(s.graph_fallbacks - seen.graph_fallbacks, 0))
        self.prefill_fallbacks.inc(max(s.prefill_fallbacks - seen.prefill_fallbacks, 0))
        for name, total in s.phase_seconds.items():
            self.phase_seconds.labels(phase=name).inc(max(total - seen.phase_seconds.get(name, 0.0), 0.0))
        self.running.set(len(engine.running))
        self.waiting.set(len(engine.waiting))
        self.prefix_queries.inc(s.prefix_cache_queries - seen.prefix_cache_queries)
        self.prefix_hits.inc(s.prefix_cache_hits - seen.prefix_cache_hits)
        self.prefix_hit_rate.set(s.prefix_cache_hit_rate)
        self.preemptions.inc(s.preemptions - seen.preemptions)
        self.free_pages.set(engine.free_pages)
        self._seen = s   # a snapshot already: later steps do not change it

    def startup(self, stages: dict[str, float], total: float) -> None:
        for name, seconds in stages.items():
            self.startup_seconds.labels(stage=name).set(seconds)
        self.startup_total.set(total)
        self.ready.set(1)

    def request_finished(self, reason: str | None) -> None:
        self.finished.labels(finish_reason=reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
