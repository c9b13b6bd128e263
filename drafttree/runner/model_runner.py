"""Owns the models, the KV caches and the per-row device state (one `RoundContext`, which the
round functions and their CUDA graphs take), the CUDA graphs over them and the per-phase timer;
runs prefill and rounds. Every step of a round comes from the phase table (`phase_table`)."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from drafttree.config import ModelConfig
from drafttree.models.decoder import DecoderLM
from drafttree.models.dflash import DFlashDrafter
from drafttree.models.kv_cache import NULL_PAGE, KVLayout, PagedKVCache, attn_meta, causal
from drafttree.parallel.comm import gather_objects
from drafttree.parallel.commands import CommandChannel, command
from drafttree.phases import Phase, SpecConfig, batch_bucket, batch_buckets
from drafttree.runner.cost import CostMeasure
from drafttree.runner.cuda_graph import GraphKey, RoundGraphs
from drafttree.runner.logit_rows import (
    LogitRows,
    PrefillLogprobs,
    PromptAsk,
    commit_first,
    first_logprobs,
    process_first,
    prompt_logprobs,
)
from drafttree.runner.phase_table import PROCESSED_MODES, PhaseStep, bucket_steps, processed_mode, round_steps, step
from drafttree.runner.phase_timer import PhaseTimer
from drafttree.runner.prefill_graph import PrefillGraphs
from drafttree.runner.prefill_plan import PrefillLimits, at_offsets, reach
from drafttree.runner.round_buffers import allocate_round_state
from drafttree.runner.timing import run_seconds
from drafttree.sampling import SampleMode, SamplingParams, SamplingTensors, pick_tokens
from drafttree.spec_decode.logits import RowLogits
from drafttree.spec_decode.rounds import prefill_forward
from drafttree.spec_decode.state import RoundContext, RoundState
from drafttree.structured.masks import apply_token_masks
from drafttree.structured.tree import HostTrees

log = logging.getLogger(__name__)
IDLE_PROGRESS_S = 10.0   # how often the work left for while idle says how far it is

# Tokens per KV page. 16, as vLLM: a request wastes under one page on average (its last, partly
# filled), prefix caching shares whole pages (a shorter page shares more of a common prompt), and
# the block tables stay small (a 32k context is 2,048 entries). A gather per attention read costs
# the same per token whatever the page size on the torch path.
DEFAULT_PAGE_SIZE = 16


@dataclass
class CacheConfig:
    max_num_seqs: int       # rows of the round state = the largest batch
    max_model_len: int      # prompt + generated tokens per request
    headroom: int           # extra positions a round writes past the committed length (spec.kv_headroom)
    page_size: int = DEFAULT_PAGE_SIZE
    num_pages: int = 0      # pages in the pool, the null page included; 0: enough for every row at max_len

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.num_pages == 0:
            self.num_pages = 1 + self.max_num_seqs * self.pages_per_row

    @property
    def pages_per_row(self) -> int:
        """Block-table width: pages that hold max_len positions."""
        return -(-self.max_len // self.page_size)

    def pages_for(self, positions: int) -> int:
        return -(-positions // self.page_size)

    @property
    def max_len(self) -> int:
        return self.max_model_len + self.headroom

    @property
    def kv_buckets(self) -> list[int]:
        """Attention lengths rounds run at (graphs are captured for each): 1024 * 4^i, capped."""
        out, n = [], 1024
        while n < self.max_len:
            out.append(n)
            n *= 4
        return out + [self.max_len]

    @property
    def batch_buckets(self) -> list[int]:
        return batch_buckets(self.max_num_seqs)

    def batch_bucket(self, b: int) -> int:
        return batch_bucket(b, self.max_num_seqs)

    def kv_bucket(self, needed: int) -> int:
        return next(n for n in self.kv_buckets if n >= min(needed, self.max_len))

    def kv_tight(self, needed: int) -> int:
        """Attention length for CPU rounds without a graph runner: the next multiple of 128, so attention
        does not sweep a mostly-masked 1024-slot bucket. On CUDA, eager rounds keep the buckets,
        so a graph and its eager fallback run the same shapes."""
        return min(-(-needed // 128) * 128, self.max_len)


@dataclass
class RunnerCounters:
    """What the runner counted since its last reset: seconds per phase (device time on CUDA), and
    rounds and prefills that ran eagerly although graphs were captured, and rounds that replayed
    another set's graphs while theirs were still to come (`RoundGraphs.replay`)."""
    phase_seconds: dict[str, float] = field(default_factory=dict)
    graph_fallbacks: int = 0
    prefill_fallbacks: int = 0
    graph_stand_ins: int = 0


class ModelRunner:
    def __init__(self, target: DecoderLM, drafter: DFlashDrafter | None, spec: SpecConfig,
                 cache: CacheConfig, device: torch.device, dtype: torch.dtype) -> None:
        self.cache_cfg, self.device, self.dtype = cache, device, dtype
        tc: ModelConfig = target.cfg
        rows, pages, ps = cache.max_num_seqs, cache.num_pages, cache.page_size
        if cache.headroom != spec.kv_headroom:
            raise ValueError(f"cache headroom {cache.headroom} != spec.kv_headroom {spec.kv_headroom}")
        # The drafter's context K/V is per position too: one page id names both pools' page, so
        # one block table (and one prefix-cache entry) serves the target and the drafter. Each
        # pool has its model's own widths (an MLA target's: the latent in K, no V; a tensor-parallel
        # rank's: its KV heads).
        kv = PagedKVCache.allocate(target.kv_layout, pages, ps, dtype, device)
        dkv, capture_layers, feat = None, (), 0
        if drafter is not None:
            dc = drafter.cfg.model
            dkv = PagedKVCache.allocate(KVLayout.of(dc), pages, ps, dtype, device)
            capture_layers = drafter.cfg.target_layer_ids
            feat = len(capture_layers) * tc.hidden_size
        state = allocate_round_state(tc, spec, rows, cache.pages_per_row, feat, dtype, device)
        self.logit_rows = LogitRows(state.logits)
        # what the last prefill gave besides its tokens (log-probabilities), for the engine to read
        self.prefill_logprobs = PrefillLogprobs()
        self.round_ctx = RoundContext(target, drafter, spec, state, kv, dkv, capture_layers, rows)
        # Host-side bound on any row's pending drafter features (state.ctx_n), kept without a
        # sync: a verify leaves at most max_commit, a decode step adds one, a context phase
        # leaves one. Prefill and parking set 1, within any bound.
        self.ctx_bound = 1
        self.graphs: RoundGraphs | None = None            # `capture` makes them
        self.prefill_graphs: PrefillGraphs | None = None
        self.compile_jobs: list[tuple[int, SampleMode, int, PhaseStep]] = []   # `compile_later`
        self.idle_work: dict[str, list[float]] = {}   # `capture_next`'s kind of work -> [host seconds, pieces]
        self.cost_job: CostMeasure | None = None   # the cost table timed while idle (`begin_costs`)
        self._idle_said = 0.0   # when `capture_next` last said how far it is
        self.timer = PhaseTimer(torch.device(device))
        self._mask_stage: torch.Tensor | None = None     # `mask_stage`'s buffer
        self._cand_host: tuple[torch.Tensor, torch.Tensor] | None = None   # `candidates`' pinned copies
        # Rank 0 of a tensor-parallel engine: the `command` methods are sent to the other ranks first.
        self.channel: CommandChannel | None = None

    def send_commands_to(self, channel: CommandChannel) -> None:
        """Rank 0 of a tensor-parallel engine: every `command` method is sent over `channel` to the
        other ranks before it runs here."""
        self.channel = channel

    # -- CUDA graphs and counters ---------------------------------------------------------------
    def capture(self, modes: tuple[SampleMode, ...], prefill: PrefillLimits | None = None,
                batch_sizes: list[int] | None = None, kv_lengths: list[int] | None = None,
                progress: Callable[[str], None] | None = None, constrained: bool = True,
                processed: bool = True, later: tuple[bool, bool] = (False, False),
                prefill_later: bool = False, warmups: int = 2,
                first_only: bool = False) -> dict[str, float]:
        """Capture the round graphs of every batch bucket, KV bucket and sampler mode in `modes`
        (or the `batch_sizes` and `kv_lengths` given), and with `prefill` the prefill graphs of
        every shape its limits allow; with `constrained` the constrained round's graphs too, with
        `processed` the processed round's (logits processing, log-probabilities); `later`: the
        (constrained, processed) rounds' graphs left for `capture_next`, `prefill_later` the
        prefill graphs (captured by it first); `warmups`: eager runs before each round graph's
        capture (one where `warm_kernels` ran every step first); `first_only`: capture only the
        sets that serve every round (`RoundGraphs.first_sets`) and leave the others for
        `capture_next`. Returns host seconds per stage
        ("graphs <phase>", "graphs warm-up", "prefill graphs"); `progress(text)` hears of each
        graph set."""
        cc = self.cache_cfg
        self.graphs = RoundGraphs(self.round_ctx, self.timer, batch_sizes or cc.batch_buckets,
                                  kv_lengths or cc.kv_buckets, modes, cc.pages_per_row,
                                  constrained, processed, later, warmups)
        first = self.graphs.first_sets() if first_only else None
        out = {f"graphs {k}": v for k, v in self.graphs.capture(progress, first).items()}
        if prefill is not None:
            t0 = time.perf_counter()
            if progress is not None:
                progress("prefill graphs")
            self.prefill_graphs = PrefillGraphs(self.round_ctx, prefill, cc.pages_per_row)
            self.prefill_graphs.capture(later=prefill_later)
            out["prefill graphs"] = time.perf_counter() - t0
        return out

    @command
    def capture_next(self) -> bool:
        """One more piece of the work `capture` and `compile_later` left for later: a step to
        compile first (`compile_later`), then a prefill graph (every request prefills), a round
        graph of the start's captured again over the compiled pieces, then one of those left for
        later (sets the start left out, the constrained and processed rounds' steps:
        `RoundGraphs.capture_next`), then an entry of the cost table (`begin_costs`); False once
        none is left. Every rank does it (its
        collectives are captured too). Each kind's seconds are logged once it is done."""
        t0 = time.perf_counter()
        if self.compile_jobs:
            kind, left = "compile steps", lambda: len(self.compile_jobs)
            B, mode, kv_len, st = self.compile_jobs.pop(0)
            try:
                self._run_parked([(B, mode, st)], kv_len)
            except Exception:
                # the start's graphs stay (pieces as torch ops): nothing is captured again over pieces
                # that did not compile
                self.compile_jobs.clear()
                if self.graphs is not None:
                    self.graphs.upgrade.clear()
                raise
        elif self.prefill_graphs is not None and self.prefill_graphs.capture_next():
            kind, left = "prefill graphs", lambda: len(self.prefill_graphs.pending)
        elif self.graphs is not None and self.graphs.recapture_next():
            kind, left = "round graphs captured again", lambda: len(self.graphs.upgrade)
        elif self.graphs is not None and self.graphs.capture_next():
            kind, left = "round graphs left for later", lambda: len(self.graphs.pending)
        elif self.cost_job is not None and self.cost_job.left:
            try:
                self.cost_job.step()
            except Exception:
                self.cost_job = None   # the start's provisional table stays
                raise
            kind, left = "cost table", lambda: self.cost_job.left
        else:
            return False
        spent = self.idle_work.setdefault(kind, [0.0, 0])
        now = time.perf_counter()
        spent[0] += now - t0
        spent[1] += 1
        if not left():
            log.info("work left for later: %s done, %d pieces in %.2f s", kind, spent[1], spent[0])
        elif now - self._idle_said >= IDLE_PROGRESS_S:
            log.info("work left for later: %s, %d pieces in %.1f s, %d left; %d pieces left in all",
                     kind, spent[1], spent[0], left(), self.graphs_pending)
        else:
            return True
        self._idle_said = now
        return True

    @property
    def graphs_pending(self) -> int:
        """Steps to compile, round graph sets to capture (again), prefill graphs and cost table
        entries to time left for `capture_next`."""
        return len(self.compile_jobs) + \
            (0 if self.graphs is None else len(self.graphs.pending) + len(self.graphs.upgrade)) + \
            (0 if self.prefill_graphs is None else len(self.prefill_graphs.pending)) + \
            (0 if self.cost_job is None else self.cost_job.left)

    @command
    def begin_costs(self, modes: tuple[SampleMode, ...]) -> None:
        """Time the cost table in `modes` while idle, an entry a `capture_next` after the graphs
        (whose timed modes' sets it replays); its table is `cost_job.table` once `left` is 0."""
        self.cost_job = CostMeasure(self, modes=modes)

    def compile_later(self, modes: tuple[SampleMode, ...], batch_sizes: list[int], kv_len: int,
                      constrained: bool = True, processed: bool = True) -> None:
        """Leave for `capture_next` what a start-up with the pieces as torch ops did not do:
        `warm_kernels`' steps, run again one a call (in the caller's scope, where the pieces
        compile), then every round graph the start captured, captured again over them."""
        self.compile_jobs = [(B, mode, kv_len, st) for B, mode, st in self._kernel_steps(modes, batch_sizes,
                                                                                        constrained, processed)]
        if self.graphs is not None:   # (those left for later are captured after the compile steps)
            self.graphs.upgrade = list(self.graphs.started)

    @torch.inference_mode()
    def warm_kernels(self, modes: tuple[SampleMode, ...], batch_sizes: list[int], kv_len: int,
                     constrained: bool = True, processed: bool = True) -> int:
        """Run every step of a round once, eagerly, at each of `batch_sizes` in each of `modes`
        over rows parked at KV length `kv_len` (with `constrained` / `processed`, those rounds'
        steps too, as `capture` takes them): what compiles (Triton's kernels, the compiled
        pieces, at one row and at several: torch.compile specializes on 1) does so here, or is
        read from its cache, before any capture. Leaves the round state as it found it; returns
        the steps run."""
        steps = self._kernel_steps(modes, batch_sizes, constrained, processed)
        self._run_parked(steps, kv_len)
        return len(steps)

    def _kernel_steps(self, modes: tuple[SampleMode, ...], batch_sizes: list[int], constrained: bool,
                      processed: bool) -> list[tuple[int, SampleMode, PhaseStep]]:
        return [(B, mode, st) for B in batch_sizes for mode in modes
                for st in bucket_steps(self.spec, B, mode, self.drafter is not None, constrained,
                                       processed and mode in PROCESSED_MODES)]

    @torch.inference_mode()
    def _run_parked(self, steps: list[tuple[int, SampleMode, PhaseStep]], kv_len: int) -> None:
        """Run (batch, mode, step)s eagerly, each over rows parked at KV length kv_len; the round
        state is put back after."""
        saved = self.state.snapshot()
        try:
            for B, mode, st in steps:
                self.state.park(0, B)
                st.run(self.round_ctx, B, kv_len, mode)
        finally:
            self.state.restore(saved)
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def describe_graphs(self) -> str:
        """What was captured, in a line: round graphs, prefill graphs (from position 0, at offsets)."""
        if self.graphs is None:
            return "no CUDA graphs"
        pg = self.prefill_graphs
        shapes = [] if pg is None or pg.failed else list(pg.graphs)
        offsets = at_offsets(shapes)
        prefill = "prefill eager" if not shapes else \
            f"{len(shapes)} prefill graphs ({len(shapes) - offsets} from position 0, {offsets} at offsets)"
        if pg is not None and pg.pending:
            prefill = f"{len(pg.pending)} prefill graphs later, while idle" if not shapes else \
                prefill + f", {len(pg.pending)} more later"
        return f"{len(self.graphs.graphs)} round graphs, {prefill}"

    def graph_keys(self) -> set[GraphKey]:
        """The round graphs captured (empty without graphs)."""
        return set() if self.graphs is None else self.graphs.keys()

    def counters(self) -> RunnerCounters:
        self.timer.collect()
        return RunnerCounters(dict(self.timer.totals), 0 if self.graphs is None else self.graphs.fallbacks,
                              0 if self.prefill_graphs is None else self.prefill_graphs.fallbacks,
                              0 if self.graphs is None else self.graphs.stand_ins)

    def collect_phase_times(self) -> None:
        """Add the phases whose CUDA events have completed to the totals (no sync)."""
        self.timer.collect()

    def reset_counters(self) -> None:
        self.timer.reset()
        if self.graphs is not None:
            self.graphs.fallbacks = self.graphs.stand_ins = 0
        if self.prefill_graphs is not None:
            self.prefill_graphs.fallbacks = 0

    # What the rounds work on, read through the one RoundContext (graphs captured over it).
    @property
    def target(self) -> DecoderLM:
        return self.round_ctx.target

    @property
    def drafter(self) -> DFlashDrafter | None:
        return self.round_ctx.drafter

    @property
    def spec(self) -> SpecConfig:
        return self.round_ctx.spec

    @property
    def state(self) -> RoundState:
        return self.round_ctx.state

    @property
    def kv(self) -> PagedKVCache:
        return self.round_ctx.kv

    @property
    def dkv(self) -> PagedKVCache | None:
        return self.round_ctx.dkv

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.round_ctx.capture_layers

    # -- prefill -----------------------------------------------------------------------------
    @command
    @torch.inference_mode()
    def prefill(self, chunks: list[PrefillChunk]) -> list[int]:
        """One padded forward over prefill chunks of several requests, each at its own start (the
        positions before it are in the cache: earlier chunks, or pages of the prefix cache). A
        chunk that ends its request's prefill (`row` >= 0) fills that row: state, block table and
        the first token, sampled (or `bonus`, known). Returns those tokens, in chunk order (the
        prefill's one host sync). Padding writes K/V past each chunk's end, into the request's own
        pages where no query sees it until real tokens overwrite it, or into the null page."""
        s, dev, cc = self.state, self.device, self.cache_cfg
        n = len(chunks)
        lens = torch.tensor([len(c.ids) for c in chunks], device=dev)
        start = torch.tensor([c.start for c in chunks], device=dev)
        W = max(len(c.ids) for c in chunks)
        ids = torch.tensor([c.ids + [0] * (W - len(c.ids)) for c in chunks], dtype=torch.long, device=dev)
        table = torch.zeros(n, cc.pages_per_row, dtype=torch.long)
        for i, c in enumerate(chunks):
            assert cc.pages_for(c.start + len(c.ids)) <= len(c.pages) <= cc.pages_per_row, \
                f"a chunk over positions {c.start}..{c.start + len(c.ids) - 1} with {len(c.pages)} pages"
            table[i, :len(c.pages)] = torch.tensor(c.pages)
        table = table.to(dev)
        asks = [(i, c.start, c.prompt_lp) for i, c in enumerate(chunks) if c.prompt_lp is not None]
        self.prefill_logprobs = PrefillLogprobs()
        with self.timer.phase("prefill"):
            graphed, keep = None, [] if asks else None   # prompt log-probabilities: every position's hidden state
            if self.prefill_graphs is not None and not asks:
                spans = [(c.start, len(c.ids)) for c in chunks]
                graphed = self.prefill_graphs.run(ids, start, lens, table, reach(spans))
            h_last, a_last = graphed if graphed is not None else self._prefill_forward(ids, start, lens, table, keep)
            if asks:
                self.prefill_logprobs.prompt = prompt_logprobs(self.target, keep[0], asks)
        done = [i for i, c in enumerate(chunks) if c.row >= 0]
        if not done:
            return []
        at = torch.tensor(done, device=dev)
        rows = torch.tensor([chunks[i].row for i in done], device=dev)
        for i in done:
            s.sampling.set_row(chunks[i].row, chunks[i].params, chunks[i].seed)
            self.logit_rows.take(chunks[i].row, chunks[i].logits)
        st = SamplingTensors(s.sampling.temperature[rows], s.sampling.top_p[rows], s.sampling.top_k[rows],
                             s.sampling.seed[rows])
        end = (start + lens)[at]
        raw = logits = self.target.logits(h_last[at][:, None])
        if any(chunks[i].mask is not None for i in done):   # a constrained request's first token
            masks = torch.full((len(done), 1, self.state.grammar.masks.shape[2]), -1, dtype=torch.int32)
            for j, i in enumerate(done):
                if chunks[i].mask is not None:
                    masks[j, 0] = torch.from_numpy(chunks[i].mask)
            logits = apply_token_masks(logits, masks.to(dev))
        mode = SampleMode.of([chunks[i].params for i in done])
        if any(chunks[i].logits is not None for i in done):   # rows without are neutral
            logits = process_first(s.logits, logits, rows, st.temperature)
            mode = processed_mode(mode)
        tok = pick_tokens(logits, st, end[:, None], mode)[:, 0]
        known = [chunks[i].bonus for i in done]
        if any(k is not None for k in known):   # recomputed after preemption: the next token is known
            tok = torch.where(torch.tensor([k is not None for k in known], device=dev),
                              torch.tensor([k or 0 for k in known], device=dev), tok)
        fresh = [j for j, i in enumerate(done) if chunks[i].bonus is None]
        grows = [j for j in fresh if chunks[done[j]].logits is not None]
        if grows:   # its output state counted what it held before; the first token joins it
            g = torch.tensor(grows, device=dev)
            commit_first(s.logits, rows[g], tok[g])
        asked = [j for j in fresh if chunks[done[j]].params.logprobs is not None]
        if asked:
            a = torch.tensor(asked, device=dev)
            lps = first_logprobs(raw[a], tok[a], s.logits.k)
            self.prefill_logprobs.first = {done[j]: lp for j, lp in zip(asked, lps)}
        s.start[rows] = end
        s.bonus[rows] = tok
        s.out_tokens[rows, 0] = tok
        s.out_n[rows] = 1
        s.block_table[rows] = table[at]
        if a_last is not None:
            s.ctx_feat[rows, 0] = a_last[at].to(s.ctx_feat.dtype)
            s.ctx_n[rows] = 1
        return tok.tolist()

    def prefill_rows(self, prompts: list[list[int]], params: list[SamplingParams], seeds: list[int]) -> list[int]:
        """Prefill prompts into rows 0..n-1 without a scheduler (benchmarks, tests): row r takes
        pages of its own, as many as a row can use where the pool has them, else enough for its
        prompt and one round's writes."""
        cc = self.cache_cfg
        k = cc.pages_per_row
        if 1 + len(prompts) * k > cc.num_pages:
            k = max(cc.pages_for(min(len(p) + cc.headroom, cc.max_len)) for p in prompts)
        assert 1 + len(prompts) * k <= cc.num_pages, f"{len(prompts)} rows of {k} pages in a pool of {cc.num_pages}"
        return self.prefill([PrefillChunk(p, 0, list(range(1 + r * k, 1 + (r + 1) * k)), params[r], seeds[r], row=r)
                             for r, p in enumerate(prompts)])

    def _prefill_forward(self, ids: torch.Tensor, start: torch.Tensor, lens: torch.Tensor, table: torch.Tensor,
                         keep: list[torch.Tensor] | None = None):
        """The padded chunks ids [n, W] at positions start[b].., through block tables `table`;
        return the final hidden state and the drafter features at each chunk's last token (`keep`:
        every position's hidden state appended to it)."""
        n, W = ids.shape
        dev = ids.device
        pos = start[:, None] + torch.arange(W, device=dev)
        kv_len = min(self.cache_cfg.pages_for(int((start + lens).max())) * self.cache_cfg.page_size,
                     self.cache_cfg.max_len)
        meta = attn_meta(start, causal(n, W, dev), kv_len, block_table=table, page_size=self.cache_cfg.page_size)
        return prefill_forward(self.round_ctx, ids, pos, meta, lens - 1, keep)

    @command
    def set_pages(self, row: int, first: int, pages: list[int]) -> None:
        """Row `row`'s block-table entries first.. become `pages` (new pages of a running
        request, written before the round that uses them)."""
        if pages:
            assert first + len(pages) <= self.cache_cfg.pages_per_row, (first, len(pages))
            self.state.block_table[row, first:first + len(pages)] = torch.tensor(pages, device=self.device)

    # -- rounds ------------------------------------------------------------------------------
    @command
    @torch.inference_mode()
    def run_round(self, B: int, mode: SampleMode, max_length: int, budget: int | None = None,
                  processed: bool = False) -> None:
        """One round for rows 0..B-1 at `budget` (0: a decode round; default: the largest the
        batch bucket may run at); `max_length` bounds their committed lengths (host-known).
        Attention covers the smallest KV bucket that holds what the round writes; a batch no
        graph fits runs eagerly at the same shapes, so both give the same tokens. `processed`: a
        processed round (some row's logits processed or log-probabilities read), in
        `processed_mode(mode)`."""
        if processed:
            mode = processed_mode(mode)
        self._run_steps(B, mode, max_length, self.round_steps(B, mode, budget, processed=processed))

    def _run_steps(self, B: int, mode: SampleMode, max_length: int, steps: tuple[PhaseStep, ...]) -> None:
        if max_length > self.cache_cfg.max_model_len:
            # its writes would pass the row's end (max_model_len + headroom slots)
            raise RuntimeError(f"a round over rows of up to {max_length} committed tokens; the cache holds "
                               f"{self.cache_cfg.max_model_len} per row")
        kv_len = self.round_kv_len(max_length)
        if self.graphs is None or not self.graphs.replay(B, mode, kv_len, steps):
            self.eager_round(B, kv_len, mode, steps)
        if self.drafter is not None:
            phases = {st.phase for st in steps}
            left = 1 if Phase.CONTEXT in phases else self.ctx_bound
            self.ctx_bound = (self.spec.max_commit if Phase.VERIFY in phases
                              else left + 1 if Phase.DECODE in phases else left)

    def round_steps(self, B: int, mode: SampleMode, budget: int | None = None, constrained: bool = False,
                    processed: bool = False) -> tuple[PhaseStep, ...]:
        """The steps of the next round over rows 0..B-1 at `budget` (default: the largest the
        batch bucket may run at in this mode): draft and verify, or a decode step, after a context
        phase when a row's pending drafter features could fill their buffer. A budget the bucket
        may not verify at is refused (`SpecConfig.width`). `constrained`: a constrained round's;
        `processed`: a processed round's."""
        bucket = self.cache_cfg.batch_bucket(B)
        if budget is None:
            budget = max(self.spec.budgets_at(bucket, mode is SampleMode.GREEDY))
        return round_steps(self.spec, bucket, budget, self._context_first(budget > 0), constrained, processed)

    @property
    def pending_bound(self) -> int:
        """The most drafter features any row may hold unwritten (0 without a drafter): its context
        is written up to that many positions before each row's committed length."""
        return self.ctx_bound if self.drafter is not None else 0

    def _context_first(self, drafting: bool) -> bool:
        """Whether the next round writes the pending drafter features first: a decode step's
        would not fit their buffer, or a draft (which writes max_commit) follows plain rounds."""
        if self.drafter is None:
            return False
        return self.ctx_bound > (self.spec.max_commit if drafting else self.spec.width(Phase.CONTEXT) - 1)

    # -- constrained rounds (structured output): the host builds the tree between draft and verify
    @command
    @torch.inference_mode()
    def run_masked_decode(self, B: int, mode: SampleMode, max_length: int, masks: Any, processed: bool = False) -> None:
        """A decode round whose picks take `masks` [B, words] (int32 numpy; rows of the batch
        bucket past B allow every token); `processed` as in `run_round`."""
        g = self.state.grammar
        bucket = self.cache_cfg.batch_bucket(B)
        g.masks[:bucket, 0].fill_(-1)
        g.masks[:B, 0].copy_(torch.from_numpy(masks))
        if processed:
            mode = processed_mode(mode)
        self._run_steps(B, mode, max_length, self.round_steps(B, mode, 0, constrained=True, processed=processed))

    @command
    @torch.inference_mode()
    def run_candidates(self, B: int, mode: SampleMode, max_length: int, processed: bool = False) -> None:
        """A constrained round's draft: the drafter's candidates per position, read by `candidates`
        (`processed`: a processed round's draft, in its mode)."""
        bucket = self.cache_cfg.batch_bucket(B)
        if processed:
            mode = processed_mode(mode)
        first = (step(self.spec, Phase.CONTEXT, bucket),) if self._context_first(True) else ()
        self._run_steps(B, mode, max_length, first + (step(self.spec, Phase.DRAFT, bucket, constrained=True),))

    def candidates(self, B: int) -> tuple[Any, Any]:
        """The candidates of the draft just run, as numpy arrays [B, D, K] (log-probabilities,
        token ids): a constrained round's one sync."""
        g = self.state.grammar
        D = self.spec.depth_at(self.cache_cfg.batch_bucket(B))
        lp, idx = g.cand_lp[:B, :D], g.cand_idx[:B, :D]
        if self.device.type != "cuda":
            return lp.numpy(force=True), idx.numpy(force=True)
        # both copies queued into pinned buffers kept for the engine's life, then one wait (the
        # host has grown the round's trees from them before the next round's read rewrites them)
        if self._cand_host is None:
            self._cand_host = (torch.empty(g.cand_lp.shape, dtype=g.cand_lp.dtype, pin_memory=True),
                               torch.empty(g.cand_idx.shape, dtype=g.cand_idx.dtype, pin_memory=True))
        out = (self._cand_host[0][:B, :D], self._cand_host[1][:B, :D])
        out[0].copy_(lp, non_blocking=True)
        out[1].copy_(idx, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        return out[0].numpy(), out[1].numpy()

    def mask_stage(self, n: int) -> Any:
        """A host buffer for `n` token masks ([n, words] int32 numpy) that `run_masked_verify`
        copies to the device without waiting (pinned on a GPU). One buffer, rewritten each
        constrained round: the host writes the next round's masks only after it has read this
        round's outputs, which the device produced after the copy."""
        words = self.state.grammar.masks.shape[2]
        if self._mask_stage is None or self._mask_stage.shape[0] < n:
            self._mask_stage = torch.empty(n, words, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        return self._mask_stage[:n].numpy()

    @command
    @torch.inference_mode()
    def run_masked_verify(self, B: int, mode: SampleMode, max_length: int, budget: int, trees: HostTrees,
                          processed: bool = False) -> None:
        """A constrained round's verify at `budget`: the host's trees (budget + 1 columns grown,
        in trees as wide as the tree buffers) replace the draft's in their rows, each node's pick
        masked by its mask; the other rows verify the draft's trees, every token allowed. Commit
        as any verify (`processed` as in `run_round`)."""
        s, g, dev = self.state, self.state.grammar, self.device
        t = s.tree
        W = trees.masks.shape[1]
        bucket = self.cache_cfg.batch_bucket(B)
        assert W == self.spec.width(Phase.VERIFY, bucket, budget), f"host trees of {W} columns at budget {budget}"
        assert trees.tokens.shape[1] == t.num_nodes, f"host trees of {trees.tokens.shape[1]} columns for tree " \
            f"buffers of {t.num_nodes}"
        g.masks[:bucket, :W].fill_(-1)
        if len(trees.rows):
            # (the masks from `mask_stage` where the caller took them from there: no wait on a GPU)
            up = lambda a: torch.from_numpy(a).to(dev, non_blocking=True)  # noqa: E731
            rows = up(trees.rows)
            for dst, src in ((t.tokens, trees.tokens), (t.parents, trees.parents), (t.depth, trees.depth),
                             (t.valid, trees.valid), (t.visible, trees.visible())):
                dst[rows] = up(src)
            g.masks[rows, :W] = up(trees.masks)
        if processed:
            mode = processed_mode(mode)
        self._run_steps(B, mode, max_length, (step(self.spec, Phase.VERIFY, bucket, budget, constrained=True,
                                                   processed=processed),))

    def round_kv_len(self, max_length: int) -> int:
        """Attention length of a round over rows whose committed lengths are <= max_length."""
        needed = max_length + self.spec.kv_headroom
        tight = self.graphs is None and self.device.type == "cpu"
        return self.cache_cfg.kv_tight(needed) if tight else self.cache_cfg.kv_bucket(needed)

    def eager_round(self, B: int, kv_len: int, mode: SampleMode, steps: tuple[PhaseStep, ...]) -> None:
        for st in steps:
            with self.timer.phase(st.phase.value):
                st.run(self.round_ctx, B, kv_len, mode)

    def run_step(self, st: PhaseStep, B: int, mode: SampleMode, kv_len: int) -> None:
        """One step over rows 0..B-1 parked (a batch bucket of B), from its graph where one was
        captured, else eagerly: what the cost model times."""
        self.state.park(0, B)
        g = None if self.graphs is None else self.graphs.get(st, B, mode, kv_len)
        if g is not None:
            g.replay()
        else:
            st.run(self.round_ctx, B, kv_len, mode)

    @torch.inference_mode()
    def time_runs(self, st: PhaseStep, B: int, mode: SampleMode, kv_len: int, reps: int,
                  warmups: int = 1) -> list[float]:
        """Seconds of each of `reps` runs of `run_step` (after `warmups` untimed ones), rows parked
        before each run."""
        g = None if self.graphs is None else self.graphs.get(st, B, mode, kv_len)
        fn = g.replay if g is not None else lambda: st.run(self.round_ctx, B, kv_len, mode)
        return run_seconds(fn, lambda: self.state.park(0, B), self.device, reps, warmups)

    @command
    def move_row(self, src: int, dst: int) -> None:
        """Keep running requests packed in rows 0..B-1 when one finishes or is preempted: the
        row's state and block table move (its K/V stay in their pages); `src` keeps no pages."""
        if src != dst:
            self.state.copy_row(src, dst)
            self.logit_rows.move(src, dst)
        self.state.block_table[src].fill_(NULL_PAGE)

    @command
    @torch.inference_mode()
    def digests(self, B: int) -> list[list[int]]:
        """What rows 0..B-1 hold (lengths, next tokens, block tables, the last round's tokens) on
        every tensor-parallel rank, in rank order: the ranks must agree exactly."""
        s, tp = self.state, self.target.tp
        mine = torch.cat([s.start[:B], s.bonus[:B], s.block_table[:B].flatten(), s.out[:B].flatten()]).tolist()
        return [mine] if tp is None else gather_objects(mine, tp)


@dataclass
class PrefillChunk:
    """Prompt tokens of one request for one prefill forward."""
    ids: list[int]                  # the chunk's tokens
    start: int                      # the position of its first token; those before are in the cache
    pages: list[int]                # the request's block table (covers start + len(ids) positions)
    params: SamplingParams
    seed: int
    row: int = -1                   # the row the request takes when this chunk ends its prefill
    bonus: int | None = None        # a recomputed request's next token (already emitted)
    mask: Any = None                # a constrained request's first-token mask (int32 words; numpy)
    logits: RowLogits | None = None  # the request's logits processing, written into its row (row >= 0)
    prompt_lp: PromptAsk | None = None   # prompt log-probabilities asked of this chunk
