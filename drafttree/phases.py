"""The one place where every phase's width per request is defined.

Capture plans, static buffers, attention masks, KV reservations and logits rows all ask
`SpecConfig.width(phase)`. DDTree verifies `budget + 1` tokens while it drafts `block_size`:
the two are different numbers and nothing may assume otherwise.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import Enum


class Phase(str, Enum):
    PREFILL = "prefill"   # variable width, runs eagerly
    DECODE = "decode"     # plain autoregressive step of the target
    CONTEXT = "context"   # the drafter's context write alone: before a decode step when its pending
                          # features could fill their buffer, before a draft when more wait than
                          # the draft writes (its catch-up); a drafter's features wait otherwise
    DRAFT = "draft"       # one drafter forward over [bonus, MASK * (block_size - 1)]
    VERIFY = "verify"     # one target forward over the draft (chain or tree)


METHODS = ("none", "dflash", "ddtree")
# A context phase writes up to this many verifies' worth of pending drafter features: plain rounds
# each leave one, so a plain stretch runs it once per CONTEXT_ROUNDS * max_commit - 1 rounds, and
# a draft after plain rounds runs it first (its catch-up). On a GPU one write of 32 positions costs
# about what one of 8 does (a small drafter is launch-bound), so this divides a plain round's
# share of it by about 4; on a CPU its cost grows with the positions, and the share stays.
CONTEXT_ROUNDS = 4


def auto_budgets(max_budget: int) -> tuple[int, ...]:
    """The DDTree budgets an adaptive engine chooses among, below and at `max_budget`: powers of
    two from 4 (a verify of 5 tokens costs about a decode step wherever a step reads weights),
    then max_budget itself. Each is one more verify graph per (batch bucket, KV bucket, mode)."""
    out, b = [], 4
    while b < max_budget:
        out.append(b)
        b *= 2
    return tuple(out) + (max_budget,)


def schedule_for(method: str, text: str | None) -> str | None:
    """The part of a budget schedule a method takes: all of it for DDTree; for DFlash (no budget)
    only a schedule whose entries all turn speculation off ('16:0'), and 'none' for any other
    given schedule, so that a schedule given for DDTree never lets DFlash fall back to the
    drafter config's; None (the drafter config's, if any) when none is given; None for plain
    decoding."""
    if method == "ddtree":
        return text
    if method != "dflash" or not text:
        return None
    if text.strip() in ("auto", "none"):
        return text.strip()
    return text if all(n == 0 for _, n in SpecConfig.parse_schedule(text)) else "none"


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes rounds run at (graphs are captured for each): powers of two, then the max."""
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    return out + [max_num_seqs]


def batch_bucket(batch: int, max_num_seqs: int) -> int:
    """The smallest of `batch_buckets(max_num_seqs)` that holds `batch` rows."""
    return next(b for b in batch_buckets(max_num_seqs) if b >= batch)


@dataclass(frozen=True)
class SpecConfig:
    method: str = "none"
    block_size: int = 0   # draft width; 0 when no drafter
    budget: int = 0       # DDTree tree nodes, root excluded (at batch 1); adaptive: the largest choice
    # Under load: ((min_batch, budget), ...) — from a batch bucket of min_batch rows on, use that
    # DDTree budget (a wide tree pays at batch 1, not when the GPU is already busy); budget 0
    # turns speculation off there (plain decode rounds, DFlash or DDTree), until a later entry.
    # Adaptive: the entry caps the budgets chosen there.
    budget_schedule: tuple[tuple[int, int], ...] = ()
    # Whether rounds in which some row samples (T > 0) speculate too; False: they decode plainly
    # (a pair whose τ at T > 0 does not pay for its round), greedy rounds still speculate.
    sampled: bool = True
    # Adaptive: every round chooses its budget among `budgets_at(batch)` (0, decode, included)
    # by measured cost and predicted acceptance; else it takes the largest of them.
    adaptive: bool = False

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown spec method {self.method!r}; choose one of {METHODS}")
        if self.method != "none" and self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 for {self.method}, got {self.block_size}")
        if self.method == "ddtree" and self.budget < 1:
            raise ValueError(f"ddtree needs budget >= 1, got {self.budget}")
        if self.budget_schedule and not self.speculative:
            raise ValueError("a budget schedule needs spec ddtree or dflash")
        if self.adaptive and not self.speculative:
            raise ValueError("an adaptive budget needs spec ddtree or dflash")
        for b, n in self.budget_schedule:
            if b < 1 or n < 0:
                raise ValueError(f"budget schedule entries need batch >= 1 and budget >= 0, got {b}:{n}")
            if self.method == "dflash" and n != 0:
                raise ValueError(f"dflash has no budget: its schedule entries can only turn it off "
                                 f"(batch:0), got {b}:{n}")

    @staticmethod
    def parse_schedule(text: str | None, budget: int = 0) -> tuple[tuple[int, int], ...]:
        """'8:16,32:4' -> ((8, 16), (32, 4)): batch buckets of 8+ rows use 16 nodes, 32+ use 4.
        '16:0': no speculation from 16 rows on. 'none' or 'auto' (the measured choice): ()."""
        if not text or text.strip() in ("none", "auto"):
            return ()
        try:
            pairs = [tuple(int(x) for x in item.split(":")) for item in text.split(",") if item.strip()]
        except ValueError:
            raise ValueError(f"budget schedule {text!r} is not of the form 'batch:budget,...'") from None
        if any(len(p) != 2 for p in pairs):
            raise ValueError(f"budget schedule {text!r} is not of the form 'batch:budget,...'")
        return tuple(sorted(pairs))  # type: ignore[arg-type]

    def _scheduled(self, batch: int) -> int | None:
        out = None
        for b, n in self.budget_schedule:
            if batch >= b:
                out = n
        return out

    def budget_at(self, batch: int) -> int:
        """The largest DDTree budget for a round over a batch bucket of `batch` rows (0: no
        speculation); DFlash's chain counts as block_size - 1 nodes."""
        return max(self.budgets_at(batch))

    @functools.lru_cache(maxsize=256)   # noqa: B019 (a frozen spec: every round asks, the answer never changes)
    def budgets_at(self, batch: int, greedy: bool = True) -> tuple[int, ...]:
        """The budgets a round over a batch bucket of `batch` rows may run at, ascending, 0 (a
        decode round) first; `greedy`: every row of the round is at temperature 0. Fixed: 0 and
        the scheduled budget; adaptive: 0 and every choice up to the scheduled cap."""
        n = self._scheduled(batch)
        if not self.speculative or n == 0 or not (greedy or self.sampled):
            return (0,)
        if self.method == "dflash":
            return (0, self.depth)
        if not self.adaptive:
            return (0, self.budget if n is None else n)
        cap = self.budget if n is None else n
        return (0,) + tuple(sorted({b for b in auto_budgets(self.budget) if b <= cap} | {cap}))

    def speculates_at(self, batch: int, greedy: bool = True) -> bool:
        """Whether rounds over a batch bucket of `batch` rows may draft and verify."""
        return len(self.budgets_at(batch, greedy)) > 1

    def phases_at(self, batch: int, greedy: bool = True, budget: int | None = None) -> tuple[Phase, ...]:
        """The phases of a round over a batch bucket of `batch` rows at `budget` (default: the
        largest it may run at), in order."""
        b = max(self.budgets_at(batch, greedy)) if budget is None else budget
        return (Phase.DRAFT, Phase.VERIFY) if b > 0 else (Phase.DECODE,)

    @property
    def budgets(self) -> tuple[int, ...]:
        """Every budget rounds may verify at, over all batch buckets (0, speculation off, is not
        one); the acceptance model predicts τ at each."""
        if not self.speculative:
            return ()
        batches = (1, *(b for b, _ in self.budget_schedule))
        return tuple(sorted({n for b in batches for n in self.budgets_at(b)} - {0}))

    @property
    def predicted_budgets(self) -> tuple[int, ...]:
        """The budgets a drafting round predicts (and its verify observes) τ at: what the
        adaptive choice reads; a fixed spec reads none, so its rounds compute none."""
        return self.budgets if self.adaptive else ()

    @property
    def speculative(self) -> bool:
        return self.method != "none"

    @property
    def depth(self) -> int:
        """Deepest draft position; at most depth + 1 tokens commit per round."""
        return self.block_size - 1 if self.speculative else 0

    def depth_at(self, batch: int = 1) -> int:
        """Draft positions whose logits a round uses: a tree of n nodes is at most n deep, so
        DDTree at budget n < block_size - 1 needs the drafter's LM head on n positions only."""
        return min(self.depth, self.budget_at(batch)) if self.method == "ddtree" else self.depth

    def width(self, phase: Phase, batch: int = 1, budget: int | None = None) -> int:
        """Tokens per request in this phase's forward, for a batch bucket of `batch` rows; the
        verify at `budget` (default: the largest the bucket may run at, which the draft phase
        builds its tree at: a smaller budget verifies that tree's first budget + 1 nodes)."""
        if phase is Phase.DECODE:
            return 1
        if phase is Phase.CONTEXT:
            return CONTEXT_ROUNDS * self.max_commit
        if phase is Phase.DRAFT:
            return self.block_size
        if phase is Phase.VERIFY:
            allowed = self.budgets_at(batch) + self.budgets_at(batch, greedy=False)
            b = self.budget_at(batch) if budget is None else budget
            assert b in allowed and b > 0, f"batch bucket {batch} verifies at budgets {allowed}, not {b}"
            return b + 1
        raise ValueError(f"{phase.value} has no fixed width")

    @property
    def round_phases(self) -> tuple[Phase, ...]:
        """The phases of a round at batch 1."""
        return self.phases_at(1)

    @property
    def max_commit(self) -> int:
        """Tokens one round can commit per request (accepted path incl. bonus)."""
        return self.block_size if self.speculative else 1

    def commit_bound(self, budget: int) -> int:
        """Tokens a round at `budget` can commit per request: one for a decode round (0)."""
        return self.max_commit if budget else 1

    @property
    def verify_width_max(self) -> int:
        """The widest verify forward at any batch size: the budget changes only at the batch
        sizes its schedule names, so those and batch 1 cover every width."""
        return max(self.budgets, default=0) + 1

    @property
    def kv_headroom(self) -> int:
        """Cache slots a round may write past the committed length (target and drafter): the
        widest forward that writes new slots (the context phase writes committed ones)."""
        if not self.speculative:
            return self.width(Phase.DECODE)
        return max(self.verify_width_max, self.width(Phase.DRAFT))
