"""The measured cost model: seconds per (phase, batch bucket, width), timed at start-up.

Every step of the phase table a round can run is timed through `ModelRunner.time_step`: on CUDA
its captured graph replayed a few times between CUDA events, on the CPU (no graphs) run eagerly
a few times. The engine divides the tokens a round is expected to commit by these costs to
choose its budget (`engine.budget`). Rows are parked while timing, and the round state is
restored afterwards.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from drafttree.parallel.comm import from_leader
from drafttree.phases import Phase, SpecConfig
from drafttree.runner.phase_table import PhaseStep, bucket_steps
from drafttree.sampling import SampleMode

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


def entries(spec: SpecConfig, bucket: int, drafter: bool = True) -> list[tuple[PhaseStep, bool]]:
    """(step, sampled) of every forward a round over the bucket can run, in the order a round
    runs them (a draft before the verifies that read its tree): the greedy round's steps, then
    the sampled decode and verifies (a sampled pick costs more where the forward is small)."""
    greedy = [(st, False) for st in bucket_steps(spec, bucket, SampleMode.GREEDY, drafter and spec.speculative)]
    sampled = bucket_steps(spec, bucket, SampleMode.SAMPLE, drafter and spec.speculative)
    if any(st.phase is Phase.VERIFY for st in sampled) and not any(st.phase is Phase.DRAFT for st, _ in greedy):
        greedy += [(st, False) for st in sampled if st.phase is Phase.DRAFT]
    return greedy + [(st, True) for st in sampled if st.phase in (Phase.DECODE, Phase.VERIFY)]


@torch.inference_mode()
def measure(runner, reps: int = REPS, time_limit_s: float = TIME_LIMIT_S) -> CostTable:
    """Time every (phase, bucket, width) of the runner's spec (`ModelRunner.time_step`: graph
    replays where captured, eager forwards otherwise). Leaves the round state as it found it."""
    spec = runner.spec
    table = CostTable(spec)
    saved = runner.state.snapshot()
    t0 = time.perf_counter()
    graphed = runner.graphs is not None
    kv_len = runner.graphs.kv_lengths[0] if graphed else runner.round_kv_len(64)
    reps = reps if graphed or runner.device.type == "cuda" else min(reps, CPU_REPS)
    for B in runner.cache_cfg.batch_buckets:
        for st, sampled in entries(spec, B, runner.drafter is not None):
            key = (st.phase, B, st.width, sampled)
            # rank 0's clock decides for every tensor-parallel rank: all must time the same forwards
            late = not graphed and from_leader(time.perf_counter() - t0 > time_limit_s, runner.target.tp)
            mode = SampleMode.SAMPLE if sampled else SampleMode.GREEDY
            if late and _estimate(table, key):
                if st.phase is Phase.DRAFT:   # its tree feeds the verifies timed after it
                    runner.run_step(st, B, mode, kv_len)
                continue
            table.seconds[key] = runner.time_step(st, B, mode, kv_len, reps)
    runner.state.restore(saved)
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
