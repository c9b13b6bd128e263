"""The engine: steps the scheduler's prefill chunks and rounds, and emits tokens. What it is comes
from its setup (`plan.resolve`, once); the pool's size from `pool_sizing`, text from `text`, its
counters from `stats`; the runner captures and times its own graphs."""
from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from drafttree.engine import prepare
from drafttree.engine.budget import BudgetChooser, extra_work, sampler_key
from drafttree.engine.config import EngineConfig
from drafttree.engine.constrained import Constrained
from drafttree.engine.inflight import Launched, RoundOutputs
from drafttree.engine.memory_plan import startup_plan
from drafttree.engine.pages import PagePool
from drafttree.engine.plan import EngineSetup, load_models, resolve, settings_of
from drafttree.engine.pool_sizing import size_pool
from drafttree.engine.processing import choice_params, row_logits
from drafttree.engine.scheduler import Scheduler, SchedulerConfig
from drafttree.engine.sequence import Sequence
from drafttree.engine.startup import Background, StartupTimes
from drafttree.engine.stats import EngineStats, Stats
from drafttree.engine.text import TextCodec, Tokenized, load_tokenizer, tokenizer_code, with_chat_template
from drafttree.parallel.comm import explain
from drafttree.parallel.group import TensorParallelError, TPGroup
from drafttree.runner.cost import timed_modes
from drafttree.runner.model_runner import CacheConfig, ModelRunner
from drafttree.sampling import SampleMode, SamplingParams
from drafttree.settings import Settings, scope
from drafttree.structured.reasoning import Reasoning

log = logging.getLogger(__name__)
T = TypeVar("T")



__all__ = ["Engine", "EngineConfig", "EngineStats"]


def _in_own_settings(method: Callable[..., T]) -> Callable[..., T]:
    """An engine method run in a scope of the engine's settings."""
    @functools.wraps(method)
    def run(self: Engine, *args: Any, **kwargs: Any) -> T:
        with scope(self.settings):
            return method(self, *args, **kwargs)
    return run


@dataclass
class BatchRows:
    """A batch's rows (`Engine._batch_rows`): counted by sampler setting (an adaptive spec's
    choice), their smallest max_budget, and whether any row has its logits processed or its
    log-probabilities read (processed steps), and how many follow a grammar (a constrained round,
    whose host grows their trees)."""
    seqs: list[Sequence]
    rows: Counter
    cap: int | None
    processed: bool
    logprobs: bool
    grammars: int

    @property
    def constrained(self) -> bool:
        return self.grammars > 0

    @property
    def extra(self) -> tuple[str, ...]:
        """The rounds' extra work, a kind of round the budget choice prices apart."""
        return extra_work(self.constrained, self.processed)


class Engine:
    def __init__(self, cfg: EngineConfig, tp: TPGroup | None = None, tokenizer: Any = None) -> None:
        """One engine; over a tensor-parallel group `tp` (given by `engine.launch.start_engine`),
        this rank's: every rank builds the same engine, and rank 0 steps it while the others
        follow its commands (`engine.launch.follow`). Its settings (`drafttree.settings`: the
        process's, with cfg's choices) are in force while it runs model code: here, in `step`
        and in `agree`; other engines in the process keep theirs. `tokenizer`: the model's, where
        the caller has loaded it already (None: loaded here, alongside the weights)."""
        self.settings: Settings = settings_of(cfg)
        self.graph_settings = self.settings   # those the graphs captured after start-up are captured in
        with scope(self.settings):
            self._start(cfg, tp, tokenizer)

    def _start(self, cfg: EngineConfig, tp: TPGroup | None, given_tokenizer: Any) -> None:
        self.cfg = cfg
        self.tp = tp
        self.dead: str | None = None       # why a tensor-parallel engine stopped (it steps no more)
        self.in_step = False
        self.ranks: Any = None   # rank 0's hold on the other ranks (`engine.launch.Ranks`): close() stops them
        self.startup = StartupTimes()
        prepare.before_engine(self.startup)
        # every option is checked here, before any weight loads; a GGUF converts once, later starts find it cached
        with self.startup.stage("convert" if not cfg.random_weights else "setup"):
            self.setup: EngineSetup = resolve(cfg, tp)
        setup = self.setup
        prepare.start_device(setup, self.startup)
        self.memory_plan = startup_plan(setup)   # CUDA: weights that cannot fit are refused before any loads
        if self.memory_plan is not None and self.leader:
            log.info("%s", self.memory_plan.format())
        self.device, self.dtype, self.spec = setup.device, setup.dtype, setup.spec
        self.model_dir, self.model_cfg = setup.model_dir, setup.target
        self.sampling_defaults = setup.sampling_defaults
        compiled = prepare.compile_caches(setup)
        tokenizer = Background(lambda: with_chat_template(   # alongside the weights
            given_tokenizer if given_tokenizer is not None else load_tokenizer(self.model_dir, cfg.trust_remote_code),
            setup.chat_template))
        # waited for before the weights where it can fail on the model's own terms: a tokenizer that
        # is the model's code (refused without trust_remote_code, or code that cannot run here), a
        # reasoning parser's markers
        if self.model_dir is not None and tokenizer_code(self.model_dir):
            tokenizer.result()
        reasoning = Reasoning(cfg.reasoning_parser, tokenizer.result()) if cfg.reasoning_parser else None
        with self.startup.stage("load weights"):
            target, drafter = load_models(setup, tp)
        size = size_pool(setup, tp)
        self.max_model_len = size.max_model_len
        cache = CacheConfig(cfg.max_num_seqs, self.max_model_len, self.spec.kv_headroom, cfg.page_size,
                            size.num_pages)
        sched = SchedulerConfig(cache, self.spec.max_commit, cfg.prefill_chunk, cfg.max_prefill_tokens, cfg.admit_min)
        with self.startup.stage("kv cache"):
            self.runner = ModelRunner(target, drafter, self.spec, cache, self.device, self.dtype)
        self.pool = PagePool(size.num_pages, cfg.page_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(sched, self.pool, self.runner)
        with self.startup.stage("tokenizer"):
            self.text = TextCodec(tokenizer.result(), set(setup.target.eos_token_ids),
                                  setup.target.vocab_size, self.model_dir, reasoning)
            self.startup.note("tokenizer", f"loaded in {tokenizer.seconds:.2f} s, alongside the weights")
        self.book = Stats(self.pool, self.scheduler, self.runner)
        self.constrained = Constrained(self.runner, self.text.tokenizer, setup.target.vocab_size, self.text.eos_ids,
                                       reasoning)
        self.stream_text = False    # a server streaming text sets this
        self.overlap = setup.overlap
        self._inflight: Launched | None = None
        self._building: list[Sequence] = []   # constrained requests whose matchers a grammar thread builds
        self._last_read = 0.0
        self._prefill_end = 0.0
        self._outputs = RoundOutputs(cfg.max_num_seqs, self.runner.state.out.shape[1], self.device)
        self._rows: BatchRows | None = None              # `_batch_rows`' last batch
        self._reasons: dict[tuple, str] = {}             # `_plain_reason` by (bucket, allowed, cap)
        compile_later = prepare.compiles_later(setup, tp, self.settings)
        if compile_later:
            # the start compiles nothing: the engine runs the pieces as torch ops, and its graphs
            # are captured again over compiled ones after it serves, while idle
            self.settings = self.settings.replace(compile="0")
        with scope(self.settings):
            if setup.cuda_graphs:
                prepare.capture_graphs(setup, self.runner, sched.prefill if setup.prefill_graphs else None,
                                       self.startup, compiled, compile_later,
                                       prepare.first_sets_only(setup, self.settings))
            self.costs = None
            if self.spec.adaptive:
                self.costs, later = prepare.cost_model(setup, self.runner, tp, self.startup)
                if later:
                    self.runner.begin_costs(timed_modes(setup.sampler_modes))
        if self.costs is not None:
            log.info("%s", self.costs.format())
        self.reset_choice()

    # -- what the engine holds ---------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.text.tokenizer

    @property
    def eos_ids(self) -> set[int]:
        return self.text.eos_ids

    @property
    def stats(self) -> EngineStats:
        """A snapshot of every counter (`Stats.collect`)."""
        return self.book.collect()

    def reset_stats(self) -> None:
        """Zero every counter: the engine's, the prefix cache's, the scheduler's and the runner's."""
        self.book.reset()

    def reset_choice(self) -> None:
        """Forget what the budget choice learned (acceptance per sampler setting, the rounds'
        observed prices): what warm-up requests taught it is not what real requests will see."""
        self.chooser = BudgetChooser(self.costs, self.spec.budgets, self.spec.adaptive)
        self._rows = None

    def attach_ranks(self, ranks: Any) -> None:
        """Rank 0 of a tensor-parallel engine: `ranks` (`engine.launch.Ranks`) holds the others;
        every runner command is sent to them over its channel first."""
        self.ranks = ranks
        self.runner.send_commands_to(ranks.channel)

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
    def encode(self, prompt: str | list[int] | Tokenized) -> tuple[list[int], str | None]:
        return self.text.encode(prompt)

    def check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("the prompt is empty (0 tokens)")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; the context holds {self.max_model_len} "
                             f"(prompt plus generated tokens), so a prompt may have 1 to "
                             f"{self.max_model_len - 1} tokens")

    def check_params(self, ids: list[int], params: SamplingParams) -> None:
        """What add_request checks of params against this model (token ids inside the vocabulary,
        bad words' tokens and how many), queueing nothing: ParamError naming the field."""
        row_logits(params, ids, self.model_cfg.vocab_size, self.eos_ids, self.tokenizer)

    def read_prompt(self, prompt: str | list[int] | Tokenized, params: SamplingParams) -> tuple[list[int], str | None]:
        """The prompt's token ids as the engine reads them, cut to their last
        `params.truncate_prompt_tokens` where asked, and the text given (`encode`)."""
        ids, text = self.encode(prompt)
        k = params.truncate_prompt_tokens
        if k is not None:
            k = self.max_model_len - 1 if k == -1 else k
            ids = ids[max(len(ids) - k, 0):]
        return ids, text

    def add_request(self, prompt: str | list[int] | Tokenized, params: SamplingParams | None = None,
                    request_id: str | None = None) -> Sequence:
        """Queue a request; returns its first choice (all n of them in `.choices`, one request id).
        Checked first (ValueError naming what is wrong), so a refused request queues nothing."""
        if self.dead is not None:
            raise TensorParallelError(self.dead)
        params = params or SamplingParams()
        ids, text = self.read_prompt(prompt, params)
        self.check_prompt(ids)
        if params.max_tokens is None:   # up to the context's end
            params = replace(params, max_tokens=self.max_model_len - len(ids))
        setup = row_logits(params, ids, self.model_cfg.vocab_size, self.eos_ids, self.tokenizer)
        choices = [Sequence(ids, p, prompt=text, index=i, logits=setup) for i, p in enumerate(choice_params(params))]
        building = False
        for seq in choices:
            seq.choices = choices
            seq.request_id = request_id if request_id is not None else choices[0].request_id
            building = self.constrained.attach(seq)
        for seq in choices:   # a constrained request queues once its matcher is built (`_queue_built`)
            if building:
                self._building.append(seq)
            else:
                self.scheduler.add(seq)
        self.book.counts.requests += 1
        self.book.counts.prompt_tokens += len(ids)
        return choices[0]

    def abort(self, seq: Sequence) -> None:
        """Finish seq's request, every choice (finish reason "abort"), and free their pages at once.
        An unread round that still writes them runs before any later use of the pages (one stream)."""
        for c in seq.choices:
            c.finish("abort")
        if self.dead is not None:
            return   # a stopped tensor-parallel engine: its ranks take no more commands
        for c in seq.choices:
            if c in self._building:
                self._building.remove(c)
            else:
                self.scheduler.free(c)

    def has_unfinished(self) -> bool:
        sc = self.scheduler
        return bool(sc.waiting or sc.prefilling or sc.running or self._building)

    def _queue_built(self) -> None:
        """Queue the constrained requests whose matchers are built, in arrival order; with nothing
        else to run, wait for the first. A build that failed ends its request (logged)."""
        sc = self.scheduler
        idle = not (sc.waiting or sc.prefilling or sc.running or self._inflight is not None)
        left = []
        for i, seq in enumerate(self._building):
            try:
                ready = self.constrained.built(seq, wait=idle and i == 0)
            except Exception:
                log.exception("request %s: building its grammar's matcher failed", seq.request_id)
                seq.finish("abort")
                continue
            if ready:
                sc.add(seq)
            else:
                left.append(seq)
        self._building = left

    @property
    def graphs_pending(self) -> int:
        """Graph sets left for `capture_later` (`EngineConfig.defer_graphs`)."""
        return self.runner.graphs_pending

    @_in_own_settings
    def capture_later(self) -> bool:
        """Capture one graph of those left for later, while no request runs (a round of one would
        find its rows parked); True while more are left."""
        if self.has_unfinished():
            raise RuntimeError("graphs are captured later only while no request runs")
        try:
            with scope(self.graph_settings):
                self._on_ranks(self.runner.capture_next)   # its warm-up and capture run collectives
        except TensorParallelError:
            raise
        except Exception:   # said, not fatal: the work of its kind stops (`ModelRunner.capture_next`)
            log.exception("work left for later failed; no more of its kind is done (its rounds replay the "
                          "start's graphs or run eagerly, counted as fallbacks)")
        job = self.runner.cost_job
        if job is not None and not job.left:
            self.runner.cost_job = None
            self.costs = job.table
            self.chooser.reprice(job.table)
            log.info("cost model timed while idle in its own modes: %s%s", prepare.measured_note(job.table),
                     prepare.keep_costs(self.setup, self.runner, self.tp, job.table))
        return self.runner.graphs_pending > 0

    # -- the loop ----------------------------------------------------------------------------
    @_in_own_settings
    def step(self) -> list[tuple[Sequence, list[int]]]:
        """This step's prefill chunks, then one round for every running request. Returns the new
        tokens: with `overlap`, those of the round launched by the previous step (this step's
        round is launched first, so the device computes it while the host reads and emits).
        Tensor-parallel: any failure (a rank lost, a collective timed out) stops the engine with
        a TensorParallelError, and every later step raises it again."""
        return self._on_ranks(self._step)

    def _on_ranks(self, work: Callable[[], T]) -> T:
        """Run `work`, which the other tensor-parallel ranks run with this one: while it runs, a
        rank lost ends the process (it would wait in a collective for good); any failure stops
        the engine with a TensorParallelError."""
        if self.tp is None:
            return work()
        self.dead = self.failure
        if self.dead is not None:
            raise TensorParallelError(self.dead)
        self.in_step = True
        try:
            return work()
        except Exception as e:
            self.dead = explain(e, self.tp, self.ranks.lost() if self.ranks is not None else None)
            raise TensorParallelError(self.dead) from e
        finally:
            self.in_step = False

    def _step(self) -> list[tuple[Sequence, list[int]]]:
        out: list[tuple[Sequence, list[int]]] = []
        if self._building:
            self._queue_built()
        self._release()
        prev = self._inflight
        if prev is not None and (prev.abandoned or not self._may_overlap()):
            out += self._drain()
            prev = None
        out += self._prefill()
        if prev is not None and not self._may_overlap():
            # a request just admitted follows a grammar: a constrained round reads what every row
            # committed before it launches (its host grows the trees from the rows' last tokens)
            out += self._drain()
            prev = None
        sc = self.scheduler
        if sc.running and not sc.reserve(self._pending(), preempt=False):
            out += self._drain()      # preemption frees pages: no unread round may still commit to them
            prev = None
            sc.reserve(0, preempt=True)
        launched = self._launch() if sc.running else None   # (sizes its attention by prev's pending commits)
        if prev is not None:
            out += self._read(prev)
        keep = self.overlap and not (launched is not None and launched.constrained)
        self._inflight = launched if keep else None
        if launched is not None and not keep:
            out += self._read(launched)
        self._release()
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
        # a prefill writes rows: a request preempted and admitted again may hold its old row
        self.constrained.drop_ahead()
        self.constrained.first_masks(chunks)
        firsts = self.runner.prefill([c for _, c in chunks])
        self._prefill_end = time.perf_counter()
        self.book.counts.prefill_seconds += self._prefill_end - t0
        lps = self.runner.prefill_logprobs
        for i, got in lps.prompt.items():
            chunks[i][0].prompt_logprobs += got
        started = sc.prefilled(chunks)
        ending = [(i, seq) for i, (seq, c) in enumerate(chunks) if c.row >= 0]
        first = {seq: (tok, lps.first.get(i)) for (i, seq), tok in zip(ending, firsts)}
        out = []
        for seq in started:
            if not seq.output_ids:   # a recomputed request's bonus token was emitted before its preemption
                tok, lp = first[seq]
                out.append((seq, self._emit(seq, [tok], None if lp is None else [lp])))
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
        running = self.scheduler.running
        return self._run_on(self._pending()) and all(s.grammar is None for s in running)

    def _run_on(self, c: int) -> bool:
        """Whether every running request, `c` unread commits later, still has tokens to make and
        context to make them in."""
        return all(len(s.output_ids) + c < s.params.max_tokens and s.length + c <= self.max_model_len
                   for s in self.scheduler.running)

    def _room_ahead(self, c: int) -> bool:
        """Whether the next round's draft may run before this round's `c` commits per request are
        read (`_run_on`), every request holding the pages that draft writes (reserved now if the
        pool has them)."""
        return self._run_on(c) and self.scheduler.reserve(c, preempt=False)

    def _launch(self) -> Launched:
        """Launch one round over the running requests (no host sync)."""
        t0 = time.perf_counter()
        running = self.scheduler.running
        self.scheduler.check_reserved(self._pending())
        mode = SampleMode.of([s.params for s in running])
        batch = self._batch_rows(running)
        budget = self._choose_budget(running, mode, batch)
        pending = self._pending()
        max_length = max(s.length for s in running) + pending
        processed = batch.processed
        logprobs = self.runner.state.logits if batch.logprobs else None
        if batch.constrained:   # structured output: masked picks, host-built trees
            assert pending == 0, "a constrained round launched before the round it follows was read"
            host_s = self.constrained.launch(running, mode, max_length, budget, processed)
            launched = self._outputs.launch(self.runner.state, list(running), t0, budget, constrained=True,
                                            processed=processed, logprobs=logprobs, host_s=host_s,
                                            host_rows=batch.grammars)
            c = self.spec.commit_bound(budget)
            if budget and not self.chooser.probed and self._room_ahead(c):
                # (a probe's next round is likely plain) behind this round's outputs' copy, so that
                # reading them waits for this round alone
                self.constrained.draft_ahead(running, mode, max_length + c, processed)
            return launched
        self.runner.run_round(len(running), mode, max_length, budget, processed=processed)
        return self._outputs.launch(self.runner.state, list(running), t0, budget, processed=processed,
                                    logprobs=logprobs)

    def _choose_budget(self, running: list[Sequence], mode: SampleMode, batch: BatchRows) -> int:
        """The next round's budget (0: decode), within the requests' max_budget caps."""
        bucket = self.runner.cache_cfg.batch_bucket(len(running))
        cap = batch.cap
        allowed = self.spec.budgets_at(bucket, mode is SampleMode.GREEDY)
        budget = self.chooser.choose(bucket, allowed, batch.rows, cap, batch.extra, batch.grammars)
        if budget == 0 and self.spec.speculative:
            key = (bucket, allowed, cap)
            if key not in self._reasons:
                self._reasons[key] = self._plain_reason(bucket, allowed, cap)
            self.book.counts.plain_rounds[self._reasons[key]] += 1
        return budget

    def _batch_rows(self, running: list[Sequence]) -> BatchRows:
        """What the round needs to know of its rows' parameters, kept while the same requests
        run, so that a round's host time does not grow by passes over them."""
        kept = self._rows
        if kept is None or len(kept.seqs) != len(running) or any(a is not b for a, b in zip(kept.seqs, running)):
            caps = [s.params.max_budget for s in running if s.params.max_budget is not None]
            kept = self._rows = BatchRows(
                list(running), Counter(sampler_key(s.params) for s in running) if self.spec.adaptive else Counter(),
                min(caps, default=None), any(s.processes for s in running),
                any(s.logprobs is not None for s in running), sum(s.grammar is not None for s in running))
        return kept

    def _plain_reason(self, bucket: int, allowed: tuple[int, ...], cap: int | None) -> str:
        """Why a round of a speculative engine decodes plainly (`EngineStats.plain_rounds`)."""
        if self.spec.budgets_at(bucket) == (0,):
            return "budget schedule"      # speculation off from this batch size on
        if allowed == (0,):
            return "speculate_sampled off"
        if cap is not None and all(b > cap for b in allowed[1:]):
            return "max_budget"           # a request's cap
        return "cost model"               # auto: a plain round was worth more

    def _read(self, launched: Launched) -> list[tuple[Sequence, list[int]]]:
        """Wait for a launched round's tokens (its one sync) and emit them. A request that finished
        after the launch (EOS or stop in the round before, abort) drops what this round made."""
        rows = launched.read()
        self.runner.collect_phase_times()
        now = time.perf_counter()
        # an overlapped round's seconds run from the previous read: the device ran it after that
        # one, while the host read, emitted and launched (overlapped rounds counted once); the
        # choice (an adaptive spec's cost table) learns from them, except across a prefill
        start = max(launched.t0, self._last_read)
        # (a constrained or processed round's seconds hold its extra work: its own kind's price)
        if self.costs is not None and self._prefill_end <= start:
            B = len(launched.seqs)
            self.chooser.observe_round(self.runner.cache_cfg.batch_bucket(B), launched.budget,
                                       not all(s.params.greedy for s in launched.seqs), now - start,
                                       extra_work(launched.constrained, launched.processed), launched.host_s,
                                       launched.host_rows)
        counts = self.book.counts
        counts.round_seconds += now - start
        self._last_read = now
        counts.rounds += 1
        budget = launched.budget
        method = self.spec.method if budget else "decode"
        counts.budget_hist[budget] += 1
        counts.method_rounds[method] += 1
        preds = 1 + self.spec.max_commit   # the predictions' first column in a row
        seen = preds + len(self.spec.predicted_budgets)   # what the target's sampler gave the tree
        out, taus = [], []
        # a fixed spec's chooser weighs no predictions
        learn: dict | None = {} if budget and self.spec.adaptive else None
        for b, (seq, row) in enumerate(zip(launched.seqs, rows)):
            if seq.finished:
                continue
            k = row[0]
            taus.append(k)
            seq.stats.rounds += 1
            seq.stats.accept_lengths.append(k)
            if learn is not None:
                learn.setdefault(sampler_key(seq.params), []).append(row[preds:])
            lps = None if seq.logprobs is None else launched.logprobs(b, k, seq.params.logprobs)
            out.append((seq, self._emit(seq, row[1:1 + k], lps)))
        for key, got in (learn or {}).items():   # one observation per setting a round, whatever the batch
            mean = [sum(col) / len(got) for col in zip(*got)]
            self.chooser.observe(key, mean[:seen - preds], mean[seen - preds:])
        if taus:   # the round's counters once, not per request: this loop is host time between rounds
            counts.accept_hist.update(taus)
            counts.method_rows[method] += len(taus)
            counts.method_tokens[method] += sum(taus)
            if budget:
                counts.spec_accept_hist.update(taus)
                counts.draft_tokens += budget * len(taus)
        return out

    def _emit(self, seq: Sequence, tokens: list[int], logprobs: list | None = None) -> list[int]:
        if len(tokens) > 1 and ((seq.params.stop and self.tokenizer is not None)
                                or (seq.grammar is not None and not self.eos_ids)):
            # a stop string ends the output at the token that completes it, as plain decoding's
            # one token a round does, not at the end of the round's commits; so does a grammar
            # that completes where the model has no end of sequence (`constrained.advance`)
            kept: list[int] = []
            for i, t in enumerate(tokens):
                if seq.finished:
                    break
                kept += self._emit(seq, [t], None if logprobs is None else logprobs[i:i + 1])
            return kept
        # the context bounds the output as max_tokens does (finish reason "length")
        kept = seq.append(tokens, self.eos_ids, self.max_model_len - len(seq.prompt_ids), logprobs)
        self.constrained.advance(seq, kept)
        self.book.counts.generated_tokens += len(kept)
        # Text is kept current every round only when something reads it mid-generation.
        if self.tokenizer is not None and (self.stream_text or seq.params.stop or seq.finished):
            self.text.detokenize(seq)
        return kept

    def _release(self) -> None:
        """Free the pages (and rows) of the requests that finished."""
        sc = self.scheduler
        for seq in [s for s in sc.running + sc.prefilling if s.finished]:
            sc.free(seq)

