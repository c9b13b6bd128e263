"""The engine: sizes the KV page pool, steps the scheduler's prefill chunks and rounds, emits tokens."""
from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from drafttree.config import parse_dtype, resolve_device
from drafttree.engine.budget import BudgetChooser
from drafttree.engine.config import EngineConfig
from drafttree.engine.inflight import Launched, RoundOutputs
from drafttree.engine.plan import load_models, resolve_spec, settings_of
from drafttree.engine.pages import PagePool
from drafttree.engine.scheduler import Scheduler, SchedulerConfig
from drafttree.engine.sequence import Sequence
from drafttree.engine.startup import StartupTimes
from drafttree.models.kv_cache import KVLayout
from drafttree.parallel.comm import explain, smallest
from drafttree.parallel.group import TensorParallelError, TPGroup
from drafttree.runner.cuda_graph import GraphRunner, sampler_modes
from drafttree.runner.model_runner import CacheConfig, ModelRunner
from drafttree.sampling import SampleMode, SamplingParams
from drafttree.settings import Settings, scope

log = logging.getLogger(__name__)
T = TypeVar("T")


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
    prefix_cache_queries: int = 0   # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0      # of those, found there (not computed again)
    preemptions: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


def _in_own_settings(method: Callable[..., T]) -> Callable[..., T]:
    """An engine method run in a scope of the engine's settings."""
    @functools.wraps(method)
    def run(self: Engine, *args: Any, **kwargs: Any) -> T:
        with scope(self.settings):
            return method(self, *args, **kwargs)
    return run


class Engine:
    def __init__(self, cfg: EngineConfig, tp: TPGroup | None = None) -> None:
        """One engine; over a tensor-parallel group `tp` (given by `engine.launch.start_engine`),
        this rank's: every rank builds the same engine, and rank 0 steps it while the others
        follow its commands (`engine.launch.follow`). Its settings (`drafttree.settings`: the
        process's, with cfg's choices) are in force while it runs model code: here, in `step`
        and in `agree`; other engines in the process keep theirs."""
        self.settings: Settings = settings_of(cfg)
        with scope(self.settings):
            self._start(cfg, tp)

    def _start(self, cfg: EngineConfig, tp: TPGroup | None) -> None:
        self.cfg = cfg
        if cfg.tensor_parallel_size != 1 and (tp is None or tp.world != cfg.tensor_parallel_size):
            raise ValueError("an engine over several ranks starts with drafttree.engine.launch.start_engine "
                             "(LLM and the command line use it)")
        modes = sampler_modes(cfg.sampler_modes)
        self.tp = tp
        self.dead: str | None = None       # why a tensor-parallel engine stopped (it steps no more)
        self.in_step = False
        self.ranks: Any = None   # rank 0's hold on the other ranks (`engine.launch.Ranks`): close() stops them
        self.device = tp.device if tp is not None else resolve_device(cfg.device)
        self.dtype = parse_dtype(cfg.dtype, str(self.device))
        self.startup = StartupTimes()
        if not cfg.random_weights:
            from drafttree.loader.default_model import resolve_model
            with self.startup.stage("convert"):   # a GGUF converts once; later starts find it cached
                resolve_model(cfg.model)
        with self.startup.stage("load weights"):
            self.model_dir, target, drafter = load_models(cfg, self.device, self.dtype, tp)
        tcfg = target.cfg
        self.spec = resolve_spec(cfg, drafter.cfg if drafter is not None else None)
        if not self.spec.speculative:
            drafter = None
        self.model_cfg = tcfg
        if cfg.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {cfg.max_num_seqs}")
        use_graphs = cfg.cuda_graphs if cfg.cuda_graphs is not None else self.device.type == "cuda"
        if use_graphs and self.spec.adaptive and not {SampleMode.GREEDY, SampleMode.SAMPLE} <= set(modes):
            raise ValueError("the per-round budget choice times greedy and sampled rounds at start-up: "
                             "sampler_modes needs greedy and sample (or a fixed budget)")
        self.max_model_len, pages = self._size_pool(tcfg, drafter, use_graphs)
        cache = CacheConfig(cfg.max_num_seqs, self.max_model_len, self.spec.kv_headroom, cfg.page_size, pages)
        sched = SchedulerConfig(cache, self.spec.max_commit, cfg.prefill_chunk, cfg.max_prefill_tokens, cfg.admit_min)
        with self.startup.stage("kv cache"):
            self.runner = ModelRunner(target, drafter, self.spec, cache, self.device, self.dtype, cfg.prefill_chunk)
        self.pool = PagePool(pages, cfg.page_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(sched, self.pool, self.runner)
        with self.startup.stage("tokenizer"):
            self.tokenizer = _load_tokenizer(self.model_dir) if self.model_dir is not None else None
        self.eos_ids = set(tcfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self.stats = EngineStats()
        self.stream_text = False    # a server streaming text sets this
        self.overlap = cfg.overlap if cfg.overlap is not None else self.device.type == "cuda"
        self._inflight: Launched | None = None
        self._last_read = 0.0
        self._prefill_end = 0.0
        self._outputs = RoundOutputs(cfg.max_num_seqs, self.runner.state.out.shape[1], self.device)
        if cfg.prefill_graphs and not use_graphs:
            raise ValueError("prefill_graphs needs CUDA graphs (a CUDA device, cuda_graphs not False)")
        if use_graphs:
            self.runner.graphs = GraphRunner(self.runner, modes)
            self.runner.graphs.capture()
            for phase, seconds in self.runner.graphs.capture_seconds.items():
                self.startup.add(f"graphs {phase}", seconds)
        if use_graphs and cfg.prefill_graphs is not False:
            from drafttree.runner.prefill_graph import PrefillGraphs
            self.runner.prefill_graphs = PrefillGraphs(self.runner, sched.prefill)   # the scheduler's own rule
            with self.startup.stage("prefill graphs"):
                self.runner.prefill_graphs.capture()
        self.costs = None
        if self.spec.adaptive:
            from drafttree.runner.cost import measure
            with self.startup.stage("cost model"):
                self.costs = measure(self.runner)
            log.info("%s", self.costs.format())
        self.chooser = BudgetChooser(self.costs, self.spec.budgets, self.spec.adaptive)

    def _size_pool(self, tcfg, drafter, use_graphs: bool) -> tuple[int, int]:
        """(max_model_len, pages in the pool): the pool takes the KV budget, at most what every
        row at max_model_len would fill; the context a request may reach follows from it."""
        cfg, ps = self.cfg, self.cfg.page_size
        if ps < 1:
            raise ValueError(f"page_size must be >= 1, got {ps}")
        # a token's K/V in every pool that holds it: the target's (MLA: its latent only; tensor-parallel:
        # this rank's KV heads, the pool holding the same pages on every rank) and the drafter's
        bpt = KVLayout.of(tcfg, self.world, 0 if self.tp is None else self.tp.rank).bytes_per_token(self.dtype)
        if drafter is not None:
            bpt += KVLayout.of(drafter.cfg.model).bytes_per_token(self.dtype)
        budget, source = self._kv_budget(drafter.cfg.model if drafter is not None else None, use_graphs)
        headroom = self.spec.kv_headroom
        pages = smallest(budget // (bpt * ps), self.tp)   # rank 0's page ids name a page on every rank
        fit = (pages - 1) * ps - headroom     # the longest context one request can hold
        wanted = cfg.max_model_len or tcfg.max_position_embeddings
        max_len = min(wanted, fit)
        fix = "raise --kv-cache-memory-gb or --gpu-memory-utilization (in Python: kv_cache_memory_gb, ...)"
        if max_len < 16:
            raise ValueError(f"KV cache budget of {budget / 2**30:.3g} GiB ({source}) holds {max(pages, 0)} pages "
                             f"of {ps} tokens at {bpt} bytes per token: a context of {max(fit, 0)} tokens; {fix}")
        if fit < wanted:
            whose = "the requested" if cfg.max_model_len else "the model's"
            log.warning("max_model_len %d < %s %d: the KV cache budget of %.3g GiB (%s) holds %d pages of %d "
                        "tokens at %d bytes per token (%d of a request's slots are headroom for a round's "
                        "writes); %s, or pass --max-model-len %d to ask for less",
                        max_len, whose, wanted, budget / 2**30, source, pages, ps, bpt, headroom, fix, max_len)
        per_row = -(-(max_len + headroom) // ps)
        return max_len, min(pages, 1 + cfg.max_num_seqs * per_row)

    def _kv_budget(self, drafter_cfg, use_graphs: bool) -> tuple[int, str]:
        cfg = self.cfg
        if cfg.kv_cache_memory_gb is not None:
            if cfg.gpu_memory_utilization is not None:
                raise ValueError("give kv_cache_memory_gb or gpu_memory_utilization, not both")
            return int(cfg.kv_cache_memory_gb * (1 << 30)), "kv_cache_memory_gb"
        if self.device.type != "cuda":
            if cfg.gpu_memory_utilization is not None:
                raise ValueError("gpu_memory_utilization sizes a CUDA device's KV pool; on "
                                 f"{self.device.type} give kv_cache_memory_gb")
            return 1 << 30, "the default on CPU"
        free, total = torch.cuda.mem_get_info(self.device)
        if cfg.gpu_memory_utilization is None:
            return int(free * 0.6), "the default: 60% of the free CUDA memory"
        util = cfg.gpu_memory_utilization
        if not 0 < util <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util}")
        # what the weights (and anything else) took is gone from `free`; the graphs' activations
        # are captured after the pool is allocated, so they are set aside by the plan's estimate
        graphs = 0
        if use_graphs:
            from drafttree.runner.cuda_graph import graph_plan
            wanted = cfg.max_model_len or self.model_cfg.max_position_embeddings
            plan = graph_plan(self.spec, self.model_cfg, drafter_cfg, cfg.max_num_seqs, [wanted], self.world)
            graphs = max((e.est_bytes for e in plan), default=0)   # the graphs share one memory pool
        budget = int(util * total) - (total - free) - graphs
        return max(budget, 0), f"gpu_memory_utilization {util}: of {total / 2**30:.1f} GiB, less what is in use" + \
            (" and the CUDA graphs' estimate" if graphs else "")

    @property
    def world(self) -> int:
        return 1 if self.tp is None else self.tp.world

    @property
    def leader(self) -> bool:
        """Whether this process steps the engine: rank 0, or the only one."""
        return self.tp is None or self.tp.leader

    @property
    def failure(self) -> str | None:
        """Why this tensor-parallel engine can step no more (a rank lost, a failed step), or None."""
        lost = self.ranks.lost() if self.dead is None and self.ranks is not None else None
        return f"{lost}; the engine stopped" if lost is not None else self.dead

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (nothing on one device); the engine steps no more."""
        if self.ranks is not None:
            ranks, self.ranks = self.ranks, None
            ranks.close(failed=self.dead is not None)   # a failed group takes no farewell
            self.dead = self.dead or "the engine was shut down"

    @_in_own_settings
    def agree(self) -> bool:
        """Whether every tensor-parallel rank holds the same round state as rank 0 (a check: the
        ranks decide alike by construction, without exchanging their decisions)."""
        self._drain()
        digests = self.runner.digests(self.runner.cache_cfg.max_num_seqs)
        return all(d == digests[0] for d in digests)

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def running(self) -> list[Sequence]:
        """Requests holding pages: running (rows 0..B-1, in order), then prefilling."""
        return self.scheduler.running + self.scheduler.prefilling

    @property
    def free_pages(self) -> int:
        return self.pool.num_free

    # -- requests ----------------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.model_dir} has no tokenizer: pass token ids instead of text")
            return self.tokenizer.encode(prompt, add_special_tokens=False), prompt
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < self.model_cfg.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} outside the vocabulary [0, {self.model_cfg.vocab_size})")
        return ids, None

    def check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("the prompt is empty (0 tokens)")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; the context holds {self.max_model_len} "
                             f"(prompt plus generated tokens), so a prompt may have 1 to "
                             f"{self.max_model_len - 1} tokens")

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> Sequence:
        if self.dead is not None:
            raise TensorParallelError(self.dead)
        params = params or SamplingParams()
        ids, text = self.encode(prompt)
        self.check_prompt(ids)
        seq = Sequence(ids, params, prompt=text)
        if request_id is not None:
            seq.request_id = request_id
        self.scheduler.add(seq)
        self.stats.requests += 1
        self.stats.prompt_tokens += len(ids)
        return seq

    def abort(self, seq: Sequence) -> None:
        """Finish seq (finish reason "abort") and free its pages at once. An unread round that
        still writes them runs before any later use of the pages (one stream)."""
        seq.finish("abort")
        if self.dead is not None:
            return   # a stopped tensor-parallel engine: its ranks take no more commands
        self.scheduler.free(seq)

    def has_unfinished(self) -> bool:
        sc = self.scheduler
        return bool(sc.waiting or sc.prefilling or sc.running)

    # -- the loop ----------------------------------------------------------------------------
    @_in_own_settings
    def step(self) -> list[tuple[Sequence, list[int]]]:
        """This step's prefill chunks, then one round for every running request. Returns the new
        tokens: with `overlap`, those of the round launched by the previous step (this step's
        round is launched first, so the device computes it while the host reads and emits).
        Tensor-parallel: any failure (a rank lost, a collective timed out) stops the engine with
        a TensorParallelError, and every later step raises it again."""
        if self.tp is None:
            return self._step()
        self.dead = self.failure
        if self.dead is not None:
            raise TensorParallelError(self.dead)
        self.in_step = True
        try:
            return self._step()
        except Exception as e:
            self.dead = explain(e, self.tp, self.ranks.lost() if self.ranks is not None else None)
            raise TensorParallelError(self.dead) from e
        finally:
            self.in_step = False

    def _step(self) -> list[tuple[Sequence, list[int]]]:
        out: list[tuple[Sequence, list[int]]] = []
        self._release()
        prev = self._inflight
        if prev is not None and (prev.abandoned or not self._may_overlap()):
            out += self._drain()
            prev = None
        out += self._prefill()
        sc = self.scheduler
        if sc.running and not sc.reserve(self._pending(), preempt=False):
            out += self._drain()      # preemption frees pages: no unread round may still commit to them
            prev = None
            sc.reserve(0, preempt=True)
        launched = self._launch() if sc.running else None   # (sizes its attention by prev's pending commits)
        if prev is not None:
            out += self._read(prev)
        self._inflight = launched if self.overlap else None
        if launched is not None and not self.overlap:
            out += self._read(launched)
        self._release()
        self.stats.preemptions = sc.preemptions
        return out

    def _drain(self) -> list[tuple[Sequence, list[int]]]:
        """Read the unread round, if any (dropped if all its requests finished)."""
        prev, self._inflight = self._inflight, None
        out = self._read(prev) if prev is not None and not prev.abandoned else []
        self._release()
        return out

    def _prefill(self) -> list[tuple[Sequence, list[int]]]:
        sc = self.scheduler
        chunks = sc.schedule_prefill()
        while not chunks and sc.unstick():
            chunks = sc.schedule_prefill()
        if not chunks:
            return []
        t0 = time.perf_counter()
        firsts = self.runner.prefill([c for _, c in chunks])
        self._prefill_end = time.perf_counter()
        self.stats.prefill_seconds += self._prefill_end - t0
        started = sc.prefilled(chunks)
        self.stats.prefix_cache_queries = self.pool.stats.queries
        self.stats.prefix_cache_hits = self.pool.stats.hits
        by_seq = dict(zip((seq for seq, c in chunks if c.row >= 0), firsts))
        # a recomputed request's bonus token was emitted before its preemption
        out = [(seq, self._emit(seq, [by_seq[seq]])) for seq in started if not seq.output_ids]
        self._release()
        return out

    def _pending(self) -> int:
        """Tokens the unread round may have committed per request beyond what the host knows:
        one where it decoded (a budget-0 round), so that a speculative engine that chose to
        decode keeps overlapping its rounds to each request's last token, as plain decoding does."""
        f = self._inflight
        return 0 if f is None else self.spec.commit_bound(f.budget)

    def _may_overlap(self) -> bool:
        """Whether the next round may launch before the unread one is read: no request may reach
        its max_tokens in the unread round (the next would be wasted on it), nor come so near the
        context's end that the next round, starting up to `_pending()` tokens later, writes past
        the cache (whose rows hold max_model_len + kv_headroom slots)."""
        c = self._pending()
        return all(len(s.output_ids) + c < s.params.max_tokens and s.length + c <= self.max_model_len
                   for s in self.scheduler.running)

    def _launch(self) -> Launched:
        """Launch one round over the running requests (no host sync)."""
        t0 = time.perf_counter()
        running = self.scheduler.running
        self.scheduler.check_reserved(self._pending())
        mode = SampleMode.of([s.params for s in running])
        budget = self._choose_budget(running, mode)
        self.runner.run_round(len(running), mode, max(s.length for s in running) + self._pending(), budget)
        return self._outputs.launch(self.runner.state, list(running), t0, budget)

    def _choose_budget(self, running: list[Sequence], mode: SampleMode) -> int:
        """The next round's budget (0: decode), within the requests' max_budget caps."""
        B = len(running)
        bucket = self.runner.cache_cfg.batch_bucket(B)
        greedy = sum(s.params.greedy for s in running)
        caps = [s.params.max_budget for s in running if s.params.max_budget is not None]
        allowed = self.spec.budgets_at(bucket, mode is SampleMode.GREEDY)
        return self.chooser.choose(bucket, allowed, greedy, B - greedy, min(caps, default=None))

    def _read(self, launched: Launched) -> list[tuple[Sequence, list[int]]]:
        """Wait for a launched round's tokens (its one sync) and emit them. A request that finished
        after the launch (EOS or stop in the round before, abort) drops what this round made."""
        rows = launched.read()
        self.runner.timer.collect()
        now = time.perf_counter()
        # an overlapped round's seconds run from the previous read: the device ran it after that
        # one, while the host read, emitted and launched (overlapped rounds counted once); the
        # choice (an adaptive spec's cost table) learns from them, except across a prefill
        start = max(launched.t0, self._last_read)
        if self.costs is not None and self._prefill_end <= start:
            B = len(launched.seqs)
            self.chooser.observe_round(self.runner.cache_cfg.batch_bucket(B), launched.budget,
                                       not all(s.params.greedy for s in launched.seqs), now - start)
        self.stats.round_seconds += now - start
        self._last_read = now
        self.stats.rounds += 1
        budget = launched.budget
        method = self.spec.method if budget else "decode"
        self.stats.budget_hist[budget] += 1
        self.stats.method_rounds[method] += 1
        preds = 1 + self.spec.max_commit   # the predictions' first column in a row
        out, taus = [], []
        for seq, row in zip(launched.seqs, rows):
            if seq.finished:
                continue
            k = row[0]
            taus.append(k)
            seq.stats.rounds += 1
            seq.stats.accept_lengths.append(k)
            if budget:
                self.chooser.observe(seq.params.greedy, budget, k, row[preds:])
            out.append((seq, self._emit(seq, row[1:1 + k])))
        if taus:   # the round's counters once, not per request: this loop is host time between rounds
            self.stats.accept_hist.update(taus)
            self.stats.method_rows[method] += len(taus)
            self.stats.method_tokens[method] += sum(taus)
        return out

    def _emit(self, seq: Sequence, tokens: list[int]) -> list[int]:
        # the context bounds the output as max_tokens does (finish reason "length")
        kept = seq.append(tokens, self.eos_ids, self.max_model_len - len(seq.prompt_ids))
        self.stats.generated_tokens += len(kept)
        # Text is kept current every round only when something reads it mid-generation.
        if self.tokenizer is not None and (self.stream_text or seq.params.stop or seq.finished):
            self._detokenize(seq)
        return kept

    def _detokenize(self, seq: Sequence) -> None:
        """Extend seq.text by the new tokens' text: decode a short window ending at the new tokens
        (not the whole output) and hold back a trailing partial character."""
        ids = seq.output_ids
        if ids and ids[-1] in self.eos_ids and not seq.params.ignore_eos:
            ids = ids[:-1]
        prefix, read = seq.detok_offsets
        before = self.tokenizer.decode(ids[prefix:read], skip_special_tokens=True)
        after = self.tokenizer.decode(ids[prefix:], skip_special_tokens=True)
        if len(after) > len(before) and (not after.endswith("\ufffd") or seq.finished):
            old = len(seq.text)
            seq.text += after[len(before):]
            seq.detok_offsets = (max(read, len(ids) - 4), len(ids))
            for stop in seq.params.stop:
                i = seq.text.find(stop, max(0, old - len(stop) + 1))
                if i >= 0:
                    seq.text = seq.text[:i]
                    seq.finish("stop")
                    seq.finish_reason = "stop"   # a stop string in the last tokens outranks the length limit

    def _release(self) -> None:
        """Free the pages (and rows) of the requests that finished."""
        sc = self.scheduler
        for seq in [s for s in sc.running + sc.prefilling if s.finished]:
            sc.free(seq)


def _load_tokenizer(path: Path):
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path))
