"""Prometheus metrics of one server, kept in their own registry and fed from the engine thread:
drafttree's own (`drafttree_*`), and vLLM's names where vLLM has the quantity (`vllm:*`, labelled
with `model_name` as vLLM's are), so that dashboards made for vLLM read this server. The gauges
are set before /ready first answers 200 (`Boot`), so they are true from then on."""
from __future__ import annotations

from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from drafttree.engine.sequence import Sequence

CONTENT_TYPE = CONTENT_TYPE_LATEST
ACCEPT_BUCKETS = tuple(float(i) for i in range(1, 17))
BUDGET_BUCKETS = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0)
# vLLM's buckets for its request latencies (seconds) and token counts
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = tuple(float(m * 10 ** e) for e in range(6) for m in (1, 2, 5))


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, model_name: str = "drafttree") -> None:
        r = self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        self.requests = Counter("drafttree_requests", "Requests admitted by the engine", registry=r)
        self.finished = Counter("drafttree_requests_finished", "Requests finished, by reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("drafttree_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generated_tokens = Counter("drafttree_generation_tokens", "Tokens generated", registry=r)
        self.rounds = Counter("drafttree_rounds", "Decoding rounds (one per engine step)", registry=r)
        self.fallbacks = Counter("drafttree_cuda_graph_fallbacks",
                                 "Rounds that ran eagerly although CUDA graphs were captured", registry=r)
        self.stand_ins = Counter("drafttree_cuda_graph_stand_ins", "Rounds that replayed another graph set "
                                 "(a longer KV bucket, a more general sampler mode) while theirs was still to be "
                                 "captured (defer_graphs)", registry=r)
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
        self.graph_sets_pending = Gauge("drafttree_cuda_graph_sets_pending",
                                        "Work left for while idle (defer_graphs): steps whose pieces compile, "
                                        "prefill graphs, round graph sets to capture again over the compiled pieces, "
                                        "and the constrained and processed rounds' sets (those prefills and rounds "
                                        "run eagerly meanwhile)", registry=r)
        self.total_pages = Gauge("drafttree_kv_total_pages", "KV pages requests may hold (the pool, less the null page)",
                                 registry=r)
        self.kv_usage = Gauge("drafttree_kv_usage", "KV pages held by requests / KV pages in all (1: full)", registry=r)
        self._vllm(r)
        self._seen = EngineStats()         # engine totals already exported
        self._cache_info = False

    def _vllm(self, r: CollectorRegistry) -> None:
        """vLLM's metrics, each with the `model_name` label (set once: `self.v`)."""
        m = ["model_name"]

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(f"vllm:{name}", doc, m + list(labels), registry=r)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(f"vllm:{name}", doc, m + list(labels), registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"vllm:{name}", doc, m, buckets=buckets, registry=r)

        self.v_running = gauge("num_requests_running", "Requests in the decoding batch or prefilling (holding KV pages)")
        self.v_waiting = gauge("num_requests_waiting", "Requests waiting for KV pages")
        self.v_kv_usage = gauge("kv_cache_usage_perc", "KV cache usage: the fraction of KV pages held (1: full)")
        self.v_cache_info = gauge("cache_config_info", "The KV cache's configuration (its labels; the value is 1)",
                                  ("block_size", "num_gpu_blocks", "enable_prefix_caching"))
        self.v_prompt_tokens = counter("prompt_tokens", "Prompt tokens admitted")
        self.v_generation_tokens = counter("generation_tokens", "Tokens generated")
        self.v_success = counter("request_success", "Requests finished, by reason", ("finished_reason",))
        self.v_prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.v_prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.v_preemptions = counter("num_preemptions", "Requests preempted")
        self.v_ttft = histogram("time_to_first_token_seconds", "Seconds from a request's admission to its first "
                                "token", TTFT_BUCKETS)
        self.v_tpot = histogram("request_time_per_output_token_seconds", "A request's seconds per output token "
                                "after its first", TPOT_BUCKETS)
        self.v_e2e = histogram("e2e_request_latency_seconds", "Seconds from a request's admission to its end",
                               E2E_BUCKETS)
        self.v_request_prompt = histogram("request_prompt_tokens", "Prompt tokens per finished request", TOKEN_BUCKETS)
        self.v_request_generation = histogram("request_generation_tokens", "Tokens generated per finished request",
                                              TOKEN_BUCKETS)
        self.v_drafts = counter("spec_decode_num_drafts", "Drafts verified: one per request per speculative round")
        self.v_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified (a DDTree round's "
                                      "budget of tree nodes, a DFlash round's chain)")
        self.v_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted (the bonus token not "
                                  "among them)")
        self.v_accepted_pos = counter("spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each "
                                      "position of the accepted path (0: the first drafted token)", ("position",))

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
        self.stand_ins.inc(max(s.graph_stand_ins - seen.graph_stand_ins, 0))
        for name, total in s.phase_seconds.items():
            self.phase_seconds.labels(phase=name).inc(max(total - seen.phase_seconds.get(name, 0.0), 0.0))
        self.running.set(len(engine.running))
        self.waiting.set(len(engine.waiting))
        self.prefix_queries.inc(s.prefix_cache_queries - seen.prefix_cache_queries)
        self.prefix_hits.inc(s.prefix_cache_hits - seen.prefix_cache_hits)
        self.prefix_hit_rate.set(s.prefix_cache_hit_rate)
        self.preemptions.inc(s.preemptions - seen.preemptions)
        self.free_pages.set(engine.free_pages)
        self.graph_sets_pending.set(engine.graphs_pending)
        self._sync_vllm(engine, s, seen)
        self._seen = s   # a snapshot already: later steps do not change it

    def _sync_vllm(self, engine: Engine, s: EngineStats, seen: EngineStats) -> None:
        name = self.model_name
        total = engine.pool.usable
        usage = 1.0 - engine.free_pages / total if total else 0.0
        self.total_pages.set(total)
        self.kv_usage.set(usage)
        self.v_kv_usage.labels(name).set(usage)
        self.v_running.labels(name).set(len(engine.running))
        self.v_waiting.labels(name).set(len(engine.waiting))
        if not self._cache_info:
            self._cache_info = True
            self.v_cache_info.labels(name, str(engine.pool.page_size), str(total),
                                     str(engine.pool.prefix_caching)).set(1)
        self.v_prompt_tokens.labels(name).inc(s.prompt_tokens - seen.prompt_tokens)
        self.v_generation_tokens.labels(name).inc(s.generated_tokens - seen.generated_tokens)
        self.v_prefix_queries.labels(name).inc(s.prefix_cache_queries - seen.prefix_cache_queries)
        self.v_prefix_hits.labels(name).inc(s.prefix_cache_hits - seen.prefix_cache_hits)
        self.v_preemptions.labels(name).inc(s.preemptions - seen.preemptions)
        new = s.spec_accept_hist - seen.spec_accept_hist   # τ -> new request-rounds
        self.v_drafts.labels(name).inc(sum(new.values()))
        self.v_draft_tokens.labels(name).inc(s.draft_tokens - seen.draft_tokens)
        self.v_accepted.labels(name).inc(sum((tau - 1) * n for tau, n in new.items()))
        # a round that committed τ tokens accepted the drafts at positions 0 .. τ - 2
        for pos in range(engine.spec.max_commit - 1 if engine.spec.speculative else 0):
            self.v_accepted_pos.labels(name, str(pos)).inc(sum(n for tau, n in new.items() if tau >= pos + 2))

    def startup(self, stages: dict[str, float], total: float) -> None:
        for name, seconds in stages.items():
            self.startup_seconds.labels(stage=name).set(seconds)
        self.startup_total.set(total)
        self.ready.set(1)

    def request_finished(self, reason: str | None, seq: Sequence | None = None) -> None:
        """A request ended (`seq`: as the engine ran it, for its latencies; None for an abort)."""
        self.finished.labels(finish_reason=reason or "unknown").inc()
        self.v_success.labels(self.model_name, reason or "unknown").inc()
        if seq is None or seq.finish_time is None:
            return
        name, n = self.model_name, len(seq.output_ids)
        self.v_e2e.labels(name).observe(seq.finish_time - seq.arrival_time)
        self.v_request_prompt.labels(name).observe(len(seq.prompt_ids))
        self.v_request_generation.labels(name).observe(n)
        if seq.first_token_time is not None:
            self.v_ttft.labels(name).observe(seq.first_token_time - seq.arrival_time)
            if n > 1:
                self.v_tpot.labels(name).observe((seq.finish_time - seq.first_token_time) / (n - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
