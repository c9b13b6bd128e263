"""A request as the engine sees it: prompt, output so far, stop handling and statistics."""
from __future__ import annotations

import itertools
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from drafttree.runner.logit_rows import Logprobs, PromptAsk
from drafttree.sampling import SamplingParams
from drafttree.spec_decode.logits import RowLogits

_ids = itertools.count()


class Status(str, Enum):
    WAITING = "waiting"       # queued (or preempted): no pages
    PREFILL = "prefill"       # holds pages, its prefill in chunks; no row yet
    RUNNING = "running"       # holds pages and a row; decoding
    FINISHED = "finished"


@dataclass
class SpecStats:
    rounds: int = 0
    accept_lengths: list[int] = field(default_factory=list)   # τ per round, bonus included

    @property
    def mean_accept_length(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0

    @property
    def histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.accept_lengths).items()))


@dataclass(eq=False)
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None   # the stop token id or stop string that ended it (not EOS)
    row: int = -1
    stats: SpecStats = field(default_factory=SpecStats)
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    seed: int = -1
    pages: list[int] = field(default_factory=list)   # block table: position j in pages[j // page_size]
    computed: int = 0         # prefill_ids with K/V in the cache (prefill progress)
    cached_tokens: int = 0    # of those, found in the prefix cache at admission
    keyed: int = 0            # pages offered to the prefix cache so far
    page_keys: list[bytes] = field(default_factory=list)   # chained hashes of its full pages, as computed
    preemptions: int = 0
    detok_offsets: tuple[int, int] = (0, 0)   # output ids [prefix, read): window already in text
    grammar: Any = None       # structured output: the grammar's matcher over the output so far
    grammar_build: Any = None  # while a grammar thread builds that matcher: its Future
    # n > 1: this is choice `index` of the request's `choices` (all of them, this one included)
    index: int = 0
    choices: list[Sequence] = field(default_factory=list, repr=False)
    logits: RowLogits | None = None   # its logits processing (penalties, bias, banned tokens), when it asks
    # log-probabilities, where asked: per output token, and per prompt position p of the prompt
    # token at p + 1 (computed at prefill): ([logprob, then the top k's], [rank, then their ids])
    logprobs: list[Logprobs] | None = None
    prompt_logprobs: list[Logprobs] | None = None

    def __post_init__(self) -> None:
        if self.seed < 0:
            self.seed = self.params.resolved_seed()
        if not self.choices:
            self.choices = [self]
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = []

    @property
    def processes(self) -> bool:
        """Whether its rounds must be processed ones (`SamplingParams.processes_logits`)."""
        return self.params.processes_logits

    @property
    def request_stats(self) -> SpecStats:
        """The request's rounds and τ per round over all its choices."""
        return SpecStats(sum(c.stats.rounds for c in self.choices),
                         [t for c in self.choices for t in c.stats.accept_lengths])

    @property
    def all_finished(self) -> bool:
        """Every choice of its request finished."""
        return all(c.finished for c in self.choices)

    def row_logits(self) -> RowLogits | None:
        """Its row's processing as the prefill that ends now writes it: the output so far counted."""
        return None if self.logits is None else replace(self.logits, output=list(self.output_ids))

    def prompt_ask(self, start: int, n: int) -> PromptAsk | None:
        """The prompt log-probabilities a prefill chunk of positions start .. start + n - 1 should
        give: those of the prompt tokens after them that it does not hold yet."""
        if self.prompt_logprobs is None:
            return None
        first = max(start, len(self.prompt_logprobs))
        end = min(start + n, len(self.prompt_ids) - 1)
        if first >= end:
            return None
        return PromptAsk(first, self.prompt_ids[first + 1:end + 1], self.params.prompt_logprobs)

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of its output tokens' log-probabilities (where they were asked)."""
        return None if self.logprobs is None else sum(lp[0] for lp, _ in self.logprobs)

    @property
    def length(self) -> int:
        """Committed tokens with K/V in the cache (the bonus token is not among them)."""
        return len(self.prompt_ids) + len(self.output_ids) - 1

    @property
    def prefill_ids(self) -> list[int]:
        """What a prefill computes: the prompt, and after a preemption the tokens generated but
        the last (the bonus, which the next round runs): recomputing them restores the state."""
        return self.prompt_ids + self.output_ids[:-1]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def append(self, tokens: list[int], eos_ids: set[int], room: int, logprobs: list[Logprobs] | None = None
               ) -> list[int]:
        """Add one round's committed tokens, stopping at EOS / stop ids / max_tokens / `room`
        (what the context leaves), with their `logprobs` where it keeps them (each cut to the
        request's count). Returns the tokens actually kept."""
        p = self.params
        limit = min(p.max_tokens, room)
        kept: list[int] = []
        for t in tokens:
            kept.append(t)
            if (t in eos_ids and not p.ignore_eos) or t in p.stop_token_ids:
                self.finish("stop")
                if not (t in eos_ids and not p.ignore_eos):
                    self.stop_reason = t
                break
            if len(self.output_ids) + len(kept) >= limit:
                self.finish("length")
                break
        self.output_ids.extend(kept)
        if self.logprobs is not None and logprobs is not None:
            k = 1 + self.params.logprobs
            self.logprobs += [(lp[:k], ids[:k]) for lp, ids in logprobs[:len(kept)]]
        if self.first_token_time is None and kept:
            self.first_token_time = time.perf_counter()
        return kept

    def finish(self, reason: str) -> None:
        if self.status is not Status.FINISHED:
            self.status = Status.FINISHED
            self.finish_reason = reason
            self.finish_time = time.perf_counter()

    def timings(self) -> dict[str, float]:
        end = self.finish_time or time.perf_counter()
        first = self.first_token_time or end
        n = len(self.output_ids)
        decode = end - first
        return {
            "ttft_s": first - self.arrival_time,
            "total_s": end - self.arrival_time,
            "decode_tokens_per_s": (n - 1) / decode if n > 1 and decode > 0 else 0.0,
            "tokens_per_s": n / (end - self.arrival_time) if end > self.arrival_time else 0.0,
        }
