"""The measured cost model: seconds per (phase, batch bucket, width), timed at start-up.

On CUDA each captured graph is replayed a few times between CUDA events; on the CPU (no graphs)
each (phase, bucket, width) the engine can run is run eagerly a few times. The engine divides
the tokens a round is expected to commit by these costs to choose its budget
(`engine.budget`). Rows are parked while timing, and the round state is restored afterwards.
"""
from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from drafttree.parallel.comm import from_leader
from drafttree.phases import Phase, SpecConfig
from drafttree.sampling import SampleMode
from drafttree.spec_decode.rounds import context_phase, decode_round, draft_phase, verify_phase

log = logging.getLogger(__name__)

REPS = 3             # timed runs per entry (after one warm-up); the median is kept
CPU_REPS = 2         # eager forwards of a large model take a while on a few cores
TIME_LIMIT_S = 5.0   # CPU: entries past this are estimated from those timed


@dataclass
class CostTable:
    """Seconds of one forward per (phase, batch bucket, width, sampled), for the round state at
    its smallest KV length (the ratio between entries is what the choice uses). Sampled: the
    target's pick with seeded noise over every row of the forward, which costs more than an
    argmax where the forward is small (decode and verify; greedy timings stand for the rest)."""
    spec: SpecConfig
    seconds: dict[tuple[Phase, int, int, bool], float] = field(default_factory=dict)
    estimated: set[tuple[Phase, int, int, bool]] = field(default_factory=set)   # scaled, not timed
    measure_s: float = 0.0

    def get(self, phase: Phase, bucket: int, width: int, sampled: bool = False) -> float:
        return self.seconds.get((phase, bucket, width, sampled)) or self.seconds[(phase, bucket, width, False)]

    def round_seconds(self, bucket: int, budget: int, sampled: bool = False) -> float:
        """A round over a batch bucket at `budget`: draft + verify, or for 0 a decode step plus
        its share of the drafter's context writes (one per max_commit - 1 decode steps)."""
        if budget == 0:
            s = self.get(Phase.DECODE, bucket, 1, sampled)
            if self.spec.speculative:
                ctx = self.spec.width(Phase.CONTEXT, bucket)
                s += self.get(Phase.CONTEXT, bucket, ctx) / max(self.spec.max_commit - 1, 1)
            return s
        draft = self.get(Phase.DRAFT, bucket, self.spec.width(Phase.DRAFT, bucket))
        return draft + self.get(Phase.VERIFY, bucket, self.spec.width(Phase.VERIFY, bucket, budget), sampled)

    def format(self) -> str:
        lines = [f"cost model ({self.measure_s:.2f} s to measure; ms per forward, * = scaled in proportion "
                 f"to tokens from a timed entry):", f"{'phase':<8} {'bucket':>6} {'width':>6} {'pick':>7} {'ms':>9}"]
        for k, s in sorted(self.seconds.items(), key=lambda kv: (kv[0][1], kv[0][0].value, kv[0][2], kv[0][3])):
            p, b, w, sampled = k
            mark = "*" if k in self.estimated else ""
            lines.append(f"{p.value:<8} {b:>6} {w:>6} {'sampled' if sampled else 'greedy':>7} {1e3 * s:>9.3f}{mark}")
        return "\n".join(lines)


def entries(spec: SpecConfig, bucket: int) -> list[tuple[Phase, int, int, bool]]:
    """(phase, width, budget, sampled) of every forward a round over the bucket can run."""
    out = [(Phase.DECODE, 1, 0, False), (Phase.DECODE, 1, 0, True)]
    if spec.speculative:
        out.insert(0, (Phase.CONTEXT, spec.width(Phase.CONTEXT, bucket), 0, False))
    budgets = [n for n in spec.budgets_at(bucket) if n]
    if budgets:
        out.append((Phase.DRAFT, spec.width(Phase.DRAFT, bucket), 0, False))
        out += [(Phase.VERIFY, spec.width(Phase.VERIFY, bucket, n), n, False) for n in budgets]
    sampled = [n for n in spec.budgets_at(bucket, greedy=False) if n]
    out += [(Phase.VERIFY, spec.width(Phase.VERIFY, bucket, n), n, True) for n in sampled]
    return out


@torch.inference_mode()
def measure(runner, reps: int = REPS, time_limit_s: float = TIME_LIMIT_S) -> CostTable:
    """Time every (phase, bucket, width) of the runner's spec: graph replays when it has graphs,
    eager forwards otherwise. Leaves the round state as it found it."""
    spec, buckets = runner.spec, runner.cache_cfg.batch_buckets
    table = CostTable(spec)
    s = runner.state
    saved = [t.clone() for t in (s.start, s.bonus, s.ctx_n, s.ctx_feat, s.out)]
    t0 = time.perf_counter()
    graphs = runner.graphs
    kv_len = graphs.kv_buckets[0] if graphs is not None else runner.round_kv_len(64)
    reps = reps if graphs is not None or runner.device.type == "cuda" else min(reps, CPU_REPS)
    for B in buckets:
        for phase, width, budget, sampled in entries(spec, B):
            key = (phase, B, width, sampled)
            # rank 0's clock decides for every tensor-parallel rank: all must time the same forwards
            late = graphs is None and from_leader(time.perf_counter() - t0 > time_limit_s, runner.target.tp)
            if late and _estimate(table, key):
                continue
            mode = SampleMode.SAMPLE if sampled else SampleMode.GREEDY
            fn = _graph_fn(graphs, phase, B, kv_len, budget, mode) if graphs is not None else \
                _eager_fn(runner, phase, B, kv_len, budget, mode)
            table.seconds[key] = _time(fn, _reset_fn(s, graphs, phase, B, kv_len, mode), runner.device, reps)
    for t, v in zip((s.start, s.bonus, s.ctx_n, s.ctx_feat, s.out), saved):
        t.copy_(v)
    table.measure_s = time.perf_counter() - t0
    return table


def _estimate(table: CostTable, key: tuple[Phase, int, int, bool]) -> bool:
    """Fill an entry past the time limit from a timed one, in proportion to the tokens of the
    forward (the CPU is compute-bound): the nearest width of the phase and pick in this bucket,
    else the same width in the largest smaller bucket. False when there is none to scale from."""
    phase, B, width, sampled = key
    timed = [(b, w) for (p, b, w, m) in table.seconds
             if p is phase and m == sampled and (p, b, w, m) not in table.estimated]
    here = [w for b, w in timed if b == B]
    if here:
        w0 = min(here, key=lambda w: abs(w - width))
        table.seconds[key] = table.seconds[(phase, B, w0, sampled)] * width / w0
    else:
        below = [b for b, w in timed if b < B and w == width]
        if not below:
            return False
        b0 = max(below)
        table.seconds[key] = table.seconds[(phase, b0, width, sampled)] * B / b0
    table.estimated.add(key)
    return True


def _eager_fn(runner, phase: Phase, B: int, kv_len: int, budget: int, mode: SampleMode) -> Callable[[], None]:
    rc = runner.round_ctx
    if phase is Phase.CONTEXT:
        return lambda: context_phase(rc, B)
    if phase is Phase.DECODE:
        return lambda: decode_round(rc, B, kv_len, mode)
    if phase is Phase.DRAFT:
        return lambda: draft_phase(rc, B, kv_len)
    tree = draft_phase(rc, B, kv_len)   # verify times itself only: its tree is drafted once
    return lambda: verify_phase(rc, B, kv_len, tree, mode, budget)


def _reset_fn(s, graphs, phase: Phase, B: int, kv_len: int, mode: SampleMode) -> Callable[[], None]:
    """Before each timed run: park the rows, and before a verify graph replay the draft graph of
    the same mode. A verify graph reads the tree its own job's draft graph left in the graph
    pool; another graph's replay may have reused that memory, and a tree of garbage indexes
    out of bounds."""
    if graphs is None or phase is not Phase.VERIFY:
        return lambda: s.park(0, B)
    draft = graphs.graphs[(Phase.DRAFT, B, mode, kv_len, 0)]

    def reset() -> None:
        s.park(0, B)
        draft.replay()
    return reset


def _graph_fn(graphs, phase: Phase, B: int, kv_len: int, budget: int, mode: SampleMode) -> Callable[[], None]:
    return graphs.graphs[(phase, B, mode, kv_len, budget)].replay


def _time(fn: Callable[[], None], reset: Callable[[], None], device: torch.device, reps: int) -> float:
    """Median seconds of `reps` runs of fn after one warm-up, each from the reset state."""
    reset()
    fn()
    out = []
    for _ in range(reps):
        reset()
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return statistics.median(out)
