"""The measured cost model: seconds per (phase, batch bucket, width), timed at start-up.

Every step of the phase table a round can run is timed through `ModelRunner.time_runs`: on CUDA
its captured graph replayed a few times between CUDA events, on the CPU (no graphs) run eagerly
until the median's relative standard error is under SPREAD (3 %), from CPU_REPS to
CPU_MAX_REPS runs: one slow run under another process's load does not set an entry, and each
entry keeps its spread (`drafttree graphs --costs` prints it). The engine divides the tokens a
round is expected to commit by these costs to choose its budget (`engine.budget`). Rows are
parked while timing, and the round state is restored afterwards.

Its budget: measuring delays the first token by at most BUDGET_S (5 s) past the first entry
(one decode or context forward at batch 1, run three times: what nothing can be predicted
from). An entry is timed only when its predicted seconds (from the nearest timed entry, in
proportion to tokens) end within the budget; from the first that would not, every entry left is
scaled from the timed ones instead. A table measured once is kept on disk and read back by later
starts of the same engine on the same machine (`engine.caches`: then nothing is timed).
"""
from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from drafttree.parallel.comm import from_leader
from drafttree.phases import Phase, SpecConfig
from drafttree.runner.phase_table import PhaseStep, bucket_steps
from drafttree.sampling import SampleMode

log = logging.getLogger(__name__)

REPS = 3             # timed runs per entry (after one warm-up); the median is kept
CPU_REPS = 3         # eager runs per entry at least (after one warm-up) ...
CPU_MAX_REPS = 9     # ... and at most, until the median's relative standard error is under SPREAD
SPREAD = 0.03
BUDGET_S = 5.0       # seconds of timing at most, past the first entry (see above)
KEEP_SPREAD = 0.10   # a table whose timed entries spread more is not kept for later starts
FORMAT = 2           # of `CostTable.to_dict`; a table kept in another is measured again

Key = tuple[Phase, int, int, bool]


@dataclass
class CostTable:
    """Seconds of one forward per (phase, batch bucket, width, sampled), for the round state at
    its smallest KV length (the ratio between entries is what the choice uses). Sampled: the
    target's pick with seeded noise over every row of the forward, which costs more than an
    argmax where the forward is small (decode and verify; greedy timings stand for the rest).
    An entry not in the table takes the other pick's."""
    spec: SpecConfig
    seconds: dict[Key, float] = field(default_factory=dict)
    estimated: set[Key] = field(default_factory=set)   # scaled, not timed
    spread: dict[Key, float] = field(default_factory=dict)   # a timed entry's relative standard error
    runs: dict[Key, int] = field(default_factory=dict)       # a timed entry's timed runs
    measure_s: float = 0.0
    source: str = "measured"   # or where it was read from

    def get(self, phase: Phase, bucket: int, width: int, sampled: bool = False) -> float:
        return self.seconds.get((phase, bucket, width, sampled)) or self.seconds[(phase, bucket, width, not sampled)]

    def round_seconds(self, bucket: int, budget: int, sampled: bool = False) -> float:
        """A round over a batch bucket at `budget`: draft + verify, or for 0 a decode step plus
        its share of the drafter's context writes (one per width(CONTEXT) - 1 decode steps; the
        catch-up before a draft that follows plain rounds writes what they left, so it is theirs)."""
        if budget == 0:
            s = self.get(Phase.DECODE, bucket, 1, sampled)
            if self.spec.speculative:
                ctx = self.spec.width(Phase.CONTEXT, bucket)
                s += self.get(Phase.CONTEXT, bucket, ctx) / max(ctx - 1, 1)
            return s
        draft = self.get(Phase.DRAFT, bucket, self.spec.width(Phase.DRAFT, bucket))
        return draft + self.get(Phase.VERIFY, bucket, self.spec.width(Phase.VERIFY, bucket, budget), sampled)

    def format(self) -> str:
        how = f"{self.measure_s:.2f} s to measure" + ("" if self.source == "measured" else f", read from {self.source}")
        lines = [f"cost model ({how}; ms per forward, the median of its runs, +- its relative standard error; "
                 f"* = scaled from the timed entries: a verify on the line through two of its bucket, else in "
                 f"proportion to tokens):",
                 f"{'phase':<8} {'bucket':>6} {'width':>6} {'pick':>7} {'ms':>9} {'spread':>7} {'runs':>4}"]
        for k, s in sorted(self.seconds.items(), key=lambda kv: (kv[0][1], kv[0][0].value, kv[0][2], kv[0][3])):
            p, b, w, sampled = k
            row = f"{p.value:<8} {b:>6} {w:>6} {'sampled' if sampled else 'greedy':>7} {1e3 * s:>9.3f}"
            if k in self.estimated:
                lines.append(row + "*")
            else:
                lines.append(row + f" {'+-%.1f%%' % (100 * self.spread.get(k, 0.0)):>7} {self.runs.get(k, 0):>4}")
        return "\n".join(lines)

    def worst_spread(self) -> float:
        """The largest relative standard error of a timed entry (0 for none)."""
        return max((v for k, v in self.spread.items() if k not in self.estimated), default=0.0)

    def to_dict(self) -> dict[str, Any]:
        """The entries, JSON-ready (the spec is the reader's: it is part of the table's key)."""
        return {"format": FORMAT, "measure_s": self.measure_s,
                "entries": [[p.value, b, w, m, s, k in self.estimated, self.spread.get(k, 0.0), self.runs.get(k, 0)]
                            for k, s in self.seconds.items() for p, b, w, m in (k,)]}

    @classmethod
    def from_dict(cls, spec: SpecConfig, data: dict[str, Any], source: str) -> "CostTable":
        """The table `to_dict` wrote, for `spec`; ValueError if it is not one."""
        if data.get("format") != FORMAT:
            raise ValueError(f"cost table format {data.get('format')!r}, expected {FORMAT}")
        t = cls(spec, measure_s=float(data["measure_s"]), source=source)
        for p, b, w, m, s, est, spread, runs in data["entries"]:
            key = (Phase(p), int(b), int(w), bool(m))
            t.seconds[key] = float(s)
            if est:
                t.estimated.add(key)
            else:
                t.spread[key], t.runs[key] = float(spread), int(runs)
        return t

    def covers(self, buckets: list[int], drafter: bool = True) -> bool:
        """Whether every entry a round over these buckets prices is here."""
        try:
            for B in buckets:
                for st, sampled in entries(self.spec, B, drafter):
                    self.get(st.phase, B, st.width, sampled)
        except KeyError:
            return False
        return True


def entries(spec: SpecConfig, bucket: int, drafter: bool = True) -> list[tuple[PhaseStep, bool]]:
    """(step, sampled) of every forward a round over the bucket can run, in the order a round
    runs them (a draft before the verifies that read its tree): the greedy round's steps, then
    the sampled decode and verifies (a sampled pick costs more where the forward is small)."""
    greedy = [(st, False) for st in bucket_steps(spec, bucket, SampleMode.GREEDY, drafter and spec.speculative)]
    sampled = bucket_steps(spec, bucket, SampleMode.SAMPLE, drafter and spec.speculative)
    if any(st.phase is Phase.VERIFY for st in sampled) and not any(st.phase is Phase.DRAFT for st, _ in greedy):
        greedy += [(st, False) for st in sampled if st.phase is Phase.DRAFT]
    return greedy + [(st, True) for st in sampled if st.phase in (Phase.DECODE, Phase.VERIFY)]


def timing_modes(modes: tuple[SampleMode, ...]) -> dict[bool, SampleMode | None]:
    """The sampler mode each pick is timed in (greedy: GREEDY; sampled: SAMPLE, else FILTERED),
    None for a pick the engine runs no graphs of: its entries take the other pick's."""
    return {False: SampleMode.GREEDY if SampleMode.GREEDY in modes else None,
            True: next((m for m in (SampleMode.SAMPLE, SampleMode.FILTERED) if m in modes), None)}


def timed_modes(modes: tuple[SampleMode, ...]) -> tuple[SampleMode, ...]:
    """The modes a cost table of these captured modes is timed in (`timing_modes`' picks)."""
    return tuple(m for m in timing_modes(modes).values() if m is not None)


@torch.inference_mode()
def measure(runner, reps: int = REPS, budget_s: float = BUDGET_S,
            modes: tuple[SampleMode, ...] = (SampleMode.GREEDY, SampleMode.SAMPLE),
            progress: Callable[[str], None] | None = None) -> CostTable:
    """Time every (phase, bucket, width) of the runner's spec in the picks of `modes`
    (`ModelRunner.time_runs`: graph replays where captured, eager forwards otherwise) within
    `budget_s`, scaling the rest. Leaves the round state as it found it."""
    job = CostMeasure(runner, reps, budget_s, modes, progress)
    while job.step():
        pass
    return job.table


class CostMeasure:
    """`measure`, an entry at a time (`step`): a server whose start left the timed modes' graphs
    for later times its table while idle, between requests. The budget counts the seconds of the
    steps only (from the first entry's end, as `measure`'s)."""

    def __init__(self, runner, reps: int = REPS, budget_s: float = BUDGET_S,
                 modes: tuple[SampleMode, ...] = (SampleMode.GREEDY, SampleMode.SAMPLE),
                 progress: Callable[[str], None] | None = None) -> None:
        spec = runner.spec
        self.runner, self.budget_s, self.progress = runner, budget_s, progress
        self.table = CostTable(spec)
        graphed = runner.graphs is not None
        self.kv_len = runner.graphs.kv_lengths[0] if graphed else runner.round_kv_len(64)
        eager = not graphed and runner.device.type != "cuda"
        self.most = CPU_MAX_REPS if eager else reps
        self.reps = CPU_REPS if eager else reps
        pick = timing_modes(modes)
        if pick[False] is None and pick[True] is None:
            pick = {False: SampleMode.GREEDY, True: None}
        # the drafter's steps run alike in every mode (their graphs are shared): timed in either
        any_mode = pick[False] or pick[True]
        drafter = runner.drafter is not None
        self.todo = [(B, st, sampled, pick[sampled] or any_mode) for B in runner.cache_cfg.batch_buckets
                     for st, sampled in entries(spec, B, drafter)
                     if pick[sampled] is not None or not st.picks]
        self.todo.sort(key=lambda job: _timing_pass(spec, *job[:2]))   # stable: a round's order within a pass
        self.done_entries = 0
        self.late = False
        self.clock = 0.0        # the budget's seconds so far, counted from the first entry's end

    @property
    def left(self) -> int:
        return len(self.todo) - self.done_entries

    @torch.inference_mode()
    def step(self) -> bool:
        """Time (or scale) the next entry; False once none is left. Leaves the round state as
        it found it."""
        if not self.left:
            return False
        t = time.perf_counter()
        runner, table, tp = self.runner, self.table, self.runner.target.tp
        i = self.done_entries
        B, st, sampled, mode = self.todo[i]
        key = (st.phase, B, st.width, sampled)

        def elapsed() -> float:
            return self.clock + time.perf_counter() - t

        if not self.late and table.seconds:
            ahead = _scaled(table, key)
            # rank 0's clock decides for every tensor-parallel rank: all must time the same forwards
            self.late = from_leader(elapsed() + (self.reps + 1) * ahead > self.budget_s, tp)
        if self.late:
            table.seconds[key] = _scaled(table, key)
            table.estimated.add(key)
        else:
            if self.progress is not None:
                self.progress(f"{i + 1}/{len(self.todo)} entries, batch {B} {st.phase.value} x{st.width}"
                              f"{' sampled' if sampled else ''}")
            saved = runner.state.snapshot()
            try:
                runs = runner.time_runs(st, B, mode, self.kv_len, self.reps)
                # more runs while the median is uncertain, as long as the next one ends within the
                # budget (every tensor-parallel rank runs as many as rank 0)
                while len(runs) < self.most and from_leader(
                        spread(runs) > SPREAD and elapsed() + statistics.median(runs) <= self.budget_s, tp):
                    runs += runner.time_runs(st, B, mode, self.kv_len, 1, warmups=0)
            finally:
                runner.state.restore(saved)
            table.seconds[key], table.spread[key], table.runs[key] = statistics.median(runs), spread(runs), len(runs)
        now = time.perf_counter()
        if i:   # the budget counts from the first entry's end (that one is always timed)
            self.clock += now - t
        table.measure_s += now - t
        self.done_entries += 1
        return bool(self.left)


def spread(runs: list[float]) -> float:
    """The relative standard error of the median of `runs`: 1.2533 sigma / sqrt(n), sigma from the
    median absolute deviation (a slow run under a passing load moves it little)."""
    if len(runs) < 2:
        return float("inf")
    m = statistics.median(runs)
    mad = statistics.median(abs(x - m) for x in runs)
    return 1.2533 * 1.4826 * mad / math.sqrt(len(runs)) / max(m, 1e-12)


def _timing_pass(spec: SpecConfig, bucket: int, st: PhaseStep) -> int:
    """Which pass times an entry: first every bucket's plain round and its narrowest verify (the
    choice between decoding and drafting a little, which every bucket makes), then the widest
    verifies, then the rest; those a budget leaves untimed are scaled from these."""
    if st.phase is not Phase.VERIFY:
        return 0
    widths = [spec.width(Phase.VERIFY, bucket, n) for n in spec.budgets_at(bucket) + spec.budgets_at(bucket, False)
              if n]
    return 0 if st.width == min(widths) else 1 if st.width == max(widths) else 2


def _scaled(table: CostTable, key: Key) -> float:
    """An entry's seconds from the timed ones: a verify between (or beyond) two timed widths of
    its bucket and pick (the decode step's among them, as width 1), along the line through them
    (a forward's cost is about affine in its tokens: the weights read once, then each token; on
    a CPU it grows slower, so a line from narrow widths errs high); else from the nearest timed entry, in
    proportion to tokens (on a GPU this overestimates larger forwards, so a budget running out
    there errs on the side of timing less): of the same model (the target's decode and verify,
    the drafter's context and draft) if any, of the same phase and pick if any, in the same
    bucket if any, else of the nearest size."""
    phase, B, width, sampled = key
    timed = [k for k in table.seconds if k not in table.estimated]
    # a decode step is the target's forward of width 1 over the same rows: a point on a verify's line
    points = phase is Phase.VERIFY and sorted(
        (k for k in timed if k[0] in (Phase.VERIFY, Phase.DECODE) and k[1] == B and k[3] == sampled),
        key=lambda k: (abs(k[2] - width), k[2]))[:2]
    if points and len(points) == 2:
        (w0, s0), (w1, s1) = sorted((k[2], table.seconds[k]) for k in points)
        return max(s0 + (s1 - s0) * (width - w0) / (w1 - w0), min(s0, s1) * 0.5)

    drafter = (Phase.CONTEXT, Phase.DRAFT)

    def rank(k: Key) -> tuple:
        p, b, w, m = k
        return ((p in drafter) != (phase in drafter), p is not phase, m != sampled, b != B, abs(b * w - B * width))
    p0, b0, w0, m0 = min(timed, key=rank)
    return table.seconds[(p0, b0, w0, m0)] * (B * width) / (b0 * w0)
