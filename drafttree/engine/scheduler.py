"""Which requests run each step: continuous batching with chunked prefill, FCFS, preemption.

A request waits (no pages), then prefills in chunks (pages, no row), then runs (pages and a row
of the round state: running[i].row == i). Every engine step runs one round over the running
requests and, before it, at most `prefill_chunk` prompt tokens of prefill chunks (continuing
prefills first, then admissions in arrival order): a long prompt delays running streams by one
chunk per step, never by its whole prefill.

Pages: a running request holds pages for every position the next round may write (its length,
an unread round's commits, and `SpecConfig.kv_headroom`: the widest forward of a round). When the
pool runs short, the newest request (running or prefilling) is preempted by recompute: its pages
are freed and it waits at the front of the queue, to prefill its prompt and the tokens it has
generated again (`Sequence.prefill_ids`) and carry on where it stopped, with the same output.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

from drafttree.engine.pages import PagePool
from drafttree.engine.sequence import Sequence, Status
from drafttree.runner.model_runner import CacheConfig, PrefillChunk
from drafttree.runner.prefill_plan import PrefillLimits


class RowOps(Protocol):
    """What the scheduler asks of the runner's round state: rows move to stay packed, running
    requests' new pages enter their rows' block tables, and how far behind the committed length
    the drafter's context may lag (`ModelRunner` does all three)."""

    def move_row(self, src: int, dst: int) -> None: ...

    def set_pages(self, row: int, first: int, pages: list[int]) -> None: ...

    @property
    def pending_bound(self) -> int:
        """The most drafter features a row may hold unwritten (0 without a drafter)."""
        ...


@dataclass(frozen=True)
class SchedulerConfig:
    cache: CacheConfig
    max_commit: int             # tokens one round may commit per request (spec.max_commit)
    prefill_chunk: int          # prompt tokens per step, all prefill chunks together
    max_prefill_tokens: int     # padded tokens in one prefill forward
    admit_min: int              # while requests run, admit only once this many rows are free

    def __post_init__(self) -> None:
        for name in ("prefill_chunk", "max_prefill_tokens", "admit_min"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @cached_property
    def prefill(self) -> PrefillLimits:
        """The rule this scheduler forms prefill forwards by; graphed prefill captures from it."""
        c = self.cache
        return PrefillLimits(c.max_num_seqs, self.prefill_chunk, self.max_prefill_tokens, c.max_model_len - 1,
                             c.max_len, tuple(c.kv_buckets))


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, pool: PagePool, rows: RowOps) -> None:
        self.cfg, self.pool, self.rows = cfg, pool, rows
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []
        self.running: list[Sequence] = []     # running[i].row == i
        self.preemptions = 0

    # -- requests ----------------------------------------------------------------------------
    def pages_needed(self, seq: Sequence) -> int:
        """The most pages `seq` can ever hold: its whole context and a round's writes past it."""
        c = self.cfg.cache
        most = min(len(seq.prompt_ids) + seq.params.max_tokens, c.max_model_len)
        return c.pages_for(min(most + c.headroom + self.cfg.max_commit, c.max_len))

    def add(self, seq: Sequence) -> None:
        need = self.pages_needed(seq)
        if need > self.pool.usable:
            raise ValueError(f"the request needs {need} KV pages of {self.pool.page_size} tokens (prompt "
                             f"{len(seq.prompt_ids)} + max_tokens {seq.params.max_tokens}); the pool has "
                             f"{self.pool.usable}: lower max_tokens or raise the KV cache memory")
        self.waiting.append(seq)

    def free(self, seq: Sequence) -> None:
        """Take a finished or aborted request out, wherever it is, and free its pages."""
        if seq.row >= 0:
            self._release_row(seq)
        elif seq in self.prefilling:
            self.prefilling.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.pool.free(seq.pages)
        seq.pages = []

    def preempt(self, seq: Sequence) -> None:
        """Free seq's pages and queue it first, to be recomputed (its output so far is kept)."""
        self.free(seq)
        seq.status, seq.computed, seq.keyed = Status.WAITING, 0, 0
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _release_row(self, seq: Sequence) -> None:
        last = self.running[-1]
        self.rows.move_row(last.row, seq.row)   # parks last's old row
        self.running[seq.row] = last
        last.row = seq.row
        self.running.pop()
        seq.row = -1

    def _victim(self) -> Sequence:
        return max(self.running + self.prefilling, key=lambda s: s.arrival_time)

    # -- rounds ------------------------------------------------------------------------------
    def reserve(self, pending: int, preempt: bool) -> bool:
        """Give every running request pages for the next round's writes: positions up to its
        length + `pending` (an unread round's commits) + the headroom. Oldest first; when the pool
        is short, preempt the newest request if `preempt`, else return False."""
        c = self.cfg.cache
        for seq in self.running:
            self._offer(seq, seq.length - max(self.cfg.max_commit, self.rows.pending_bound))
        for seq in sorted(self.running, key=lambda s: s.arrival_time):
            if seq.row < 0:
                continue   # preempted above
            need = c.pages_for(min(seq.length + pending + c.headroom, c.max_len))
            while seq.row >= 0 and len(seq.pages) < need:
                got = self.pool.allocate(need - len(seq.pages))
                if got is not None:
                    self.rows.set_pages(seq.row, len(seq.pages), got)
                    seq.pages += got
                elif not preempt:
                    return False
                else:
                    self.preempt(self._victim())
        return True

    def check_reserved(self, pending: int) -> None:
        """Every running request holds the pages its next round writes (host-side, no sync)."""
        c = self.cfg.cache
        for seq in self.running:
            want = min(seq.length + pending + c.headroom, c.max_len)
            assert len(seq.pages) * c.page_size >= want, \
                f"{seq.request_id}: {len(seq.pages)} pages for {want} positions"

    # -- prefill -----------------------------------------------------------------------------
    def schedule_prefill(self) -> list[tuple[Sequence, PrefillChunk]]:
        """This step's prefill chunks: continuing prefills first, then new requests, FCFS, within
        the step's token budget, the rows and the free pages."""
        cfg, lim = self.cfg, self.cfg.prefill
        budget, out = lim.prefill_chunk, []
        for seq in list(self.prefilling):
            if budget <= 0 or not self._fits_forward(out, seq, budget):
                return out
            chunk = self._chunk(seq, budget, out)
            if chunk is None:
                return out
            out.append((seq, chunk))
            budget -= len(chunk.ids)
        rows = lim.max_num_seqs
        used = len(self.running) + len(self.prefilling)
        if self.running and rows - used < min(cfg.admit_min, len(self.waiting)):
            return out
        while budget > 0 and self.waiting and used < rows and self._fits_forward(out, self.waiting[0], budget):
            seq = self.waiting[0]
            ids = seq.prefill_ids
            hit = self._shared(seq)
            if hit is None:
                break   # a choice of its request is computing the prompt's pages: wait for them
            seq.pages, seq.computed = hit, len(hit) * self.pool.page_size
            chunk = self._chunk(seq, budget, out)
            if chunk is None:
                self.pool.free(hit)
                seq.pages, seq.computed = [], 0
                break
            self.waiting.popleft()
            if self.pool.prefix_caching:   # (without it, a choice sharing its sibling's pages is no cache hit)
                self.pool.stats.queries += len(ids)
                self.pool.stats.hits += seq.computed
            seq.cached_tokens = seq.computed
            seq.status = Status.PREFILL
            self.prefilling.append(seq)
            out.append((seq, chunk))
            budget -= len(chunk.ids)
            used += 1
        return out

    def _shared(self, seq: Sequence) -> list[int] | None:
        """The pages seq starts with, each gaining a reference: a choice of the same request (n > 1)
        that holds the prompt's full pages computed shares them, prefix caching or not (None while
        one is still computing them: the others wait, so the prompt is computed once); else the
        prefix cache's longest match. At least the last token is computed (its hidden state gives
        the next token). A request asking for prompt log-probabilities computes its whole prompt."""
        ps = self.pool.page_size
        if seq.prompt_logprobs is not None and len(seq.prompt_logprobs) < len(seq.prompt_ids) - 1:
            return []
        full = (len(seq.prompt_ids) - 1) // ps   # pages of prompt positions only, the last token's excluded
        others = [c for c in seq.choices if c is not seq and c.pages and not c.finished] if full else []
        donor = next((c for c in others if min(c.computed, len(c.prefill_ids) - 1) >= full * ps), None)
        if donor is not None:
            shared = donor.pages[:full]
            for page in shared:
                self.pool.ref[page] += 1
            return shared
        if any(c.status is Status.PREFILL for c in others):
            return None
        ids = seq.prefill_ids
        return self.pool.match(ids, (len(ids) - 1) // ps)

    def _fits_forward(self, out: list[tuple[Sequence, PrefillChunk]], seq: Sequence, budget: int) -> bool:
        """Whether seq's next chunk joins this step's padded forward (always, if it is the first)."""
        if not out:
            return True
        n = min(budget, len(seq.prefill_ids) - seq.computed)
        widest = max([n] + [len(c.ids) for _, c in out])
        return self.cfg.prefill.fits(len(out) + 1, widest)

    def _chunk(self, seq: Sequence, budget: int, before: list[tuple[Sequence, PrefillChunk]]) -> PrefillChunk | None:
        """seq's next chunk, its pages allocated (for a last chunk also the first round's), or
        None if the pool is short."""
        c = self.cfg.cache
        ids = seq.prefill_ids
        n = min(budget, len(ids) - seq.computed)
        end = seq.computed + n
        last = end == len(ids)
        need = c.pages_for(min(end + c.headroom + self.cfg.max_commit, c.max_len) if last else end)
        if need > len(seq.pages):
            got = self.pool.allocate(need - len(seq.pages))
            if got is None:
                return None
            seq.pages += got
        row = len(self.running) + sum(ch.row >= 0 for _, ch in before) if last else -1
        bonus = seq.output_ids[-1] if seq.output_ids and last else None
        return PrefillChunk(ids[seq.computed:end], seq.computed, list(seq.pages), seq.params, seq.seed, row, bonus,
                            logits=seq.row_logits() if last else None, prompt_lp=seq.prompt_ask(seq.computed, n))

    def prefilled(self, done: list[tuple[Sequence, PrefillChunk]]) -> list[Sequence]:
        """Account a prefill forward: progress, prefix-cache keys, and the requests that start
        running (in row order), which it returns."""
        started = []
        for seq, chunk in done:
            seq.computed = chunk.start + len(chunk.ids)
            # Not the last computed token's page: the rounds rewrite the drafter's context there
            # (its features are the first pending ones).
            self._offer(seq, min(seq.computed, len(seq.prefill_ids) - 1))
            if chunk.row >= 0:
                self.prefilling.remove(seq)
                seq.row, seq.status = chunk.row, Status.RUNNING
                started.append(seq)
        for seq in sorted(started, key=lambda s: s.row):
            assert seq.row == len(self.running), (seq.row, len(self.running))
            self.running.append(seq)
        return started

    def _offer(self, seq: Sequence, final: int) -> None:
        """Offer seq's full pages of positions < `final` to the prefix cache: their K/V, the
        target's and the drafter's, are written and never rewritten. A running request's are
        those below length - max(max_commit, the runner's pending_bound): an unread round commits
        at least one token, and the drafter's pending context (written by the next draft or
        context phase) lies within pending_bound positions before the committed length."""
        if not self.pool.prefix_caching:
            return
        last = min(max(final, 0) // self.pool.page_size, len(seq.pages))
        if last > seq.keyed:
            first = max(seq.keyed, seq.cached_tokens // self.pool.page_size)   # matched pages hold their keys
            self.pool.register(seq.prefill_ids, seq.pages, first, last, seq.page_keys)
            seq.keyed = last

    def unstick(self) -> bool:
        """Nothing runs and no prefill chunk found pages: preempt the newest prefilling request
        so that an older one can go on. False if there was none to preempt."""
        if self.running or len(self.prefilling) < 2:
            return False
        self.preempt(self._victim())
        return True
