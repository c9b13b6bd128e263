"""CUDA graphs for every step of a round, each captured at its own width.

Every step and width comes from the phase table (`runner.phase_table`, widths from
`SpecConfig.width`); nothing here chooses a token count, and capture checks that the buffers a
graph reads and writes have those widths. Graphs read and write the round context's persistent
buffers (state, KV caches, the draft tree), so a replay needs no input copies and a verify graph
may replay after any draft graph of its batch bucket. Rows between the real batch size and the
bucket are parked first (`RoundState.park`).

A step whose forward does not depend on the sampler mode or the attention length is captured once
for all of them: the drafter's context write once per batch bucket (it writes K/V and attends
over nothing), the draft once per (batch bucket, KV bucket) (the drafter picks no token).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from drafttree.config import ModelConfig
from drafttree.phases import Phase, SpecConfig, batch_bucket, batch_buckets
from drafttree.runner.capture import capture_graph, collector_paused
from drafttree.runner.phase_table import (CAPTURED_MODES, LENGTHLESS, PROCESSED_MODES, PhaseStep, bucket_steps,
                                          check_widths)
from drafttree.runner.phase_timer import PhaseTimer
from drafttree.sampling import SampleMode
from drafttree.spec_decode.state import RoundContext

log = logging.getLogger(__name__)


class GraphKey(NamedTuple):
    phase: Phase
    batch: int                 # batch bucket
    mode: SampleMode | None    # None: the same graph for every mode (context, draft)
    kv_len: int                # KV bucket; 0: the same graph at every length (context)
    budget: int                # the verify's; 0 for other phases
    constrained: bool = False  # a constrained round's step (structured output)
    processed: bool = False    # a processed round's step (logits processing, log-probabilities)


def key_of(st: PhaseStep, bucket: int, mode: SampleMode, kv_len: int) -> GraphKey:
    return GraphKey(st.phase, bucket, mode if st.picks else None, kv_len if st.attends else 0,
                    st.budget, st.constrained, st.processed)


class GraphSet(NamedTuple):
    """The graphs of one (batch bucket, sampler mode, KV bucket), captured together."""
    batch: int
    mode: SampleMode
    kv_len: int

    def describe(self) -> str:
        return f"batch {self.batch}, kv {self.kv_len}, {self.mode.name.lower()}"


@dataclass(frozen=True)
class PlanEntry:
    phase: Phase
    width: int              # tokens per request in this phase's forward
    batch_sizes: tuple[int, ...]
    kv_lengths: tuple[int, ...]   # attention lengths captured (KV buckets)
    est_bytes: int          # activation estimate for the largest batch and KV bucket
    processed: bool = False  # the processed steps of this phase and width (constrained or not)
    graphs: int = 0          # graphs captured for it: batch sizes x KV lengths x sampler modes x step kinds


def phase_widths(spec: SpecConfig, phase: Phase, bucket: int, drafter: bool = True) -> set[int]:
    """The widths `phase` runs at over a batch bucket, greedy or sampled (the phase table's steps)."""
    return {st.width for mode in (SampleMode.GREEDY, SampleMode.SAMPLE)
            for st in bucket_steps(spec, bucket, mode, drafter and spec.speculative) if st.phase is phase}


def graph_plan(spec: SpecConfig, target: ModelConfig, drafter: ModelConfig | None, max_num_seqs: int,
               kv_lengths: list[int], world: int = 1, modes: tuple[SampleMode, ...] = CAPTURED_MODES,
               constrained: bool = True, processed: bool = True) -> list[PlanEntry]:
    """What `RoundGraphs.capture` captures on each rank of `world`, in sampler `modes`; needs no
    GPU. A phase's entry holds the plain (and with `constrained` the constrained) rounds' steps;
    with `processed`, the processed rounds' decode and verify steps in the processed modes have
    entries of their own. Each entry counts its graphs as `graph_keys` gives them."""
    buckets = batch_buckets(max_num_seqs)
    out = []
    V = target.vocab_size
    pmodes = [m for m in PROCESSED_MODES if m in modes] if processed else []
    keys = graph_keys(spec, max_num_seqs, kv_lengths, modes, True, constrained, processed)   # entries as phase_widths'

    def count(phase: Phase, W: int, proc: bool) -> int:
        return sum(k.phase is phase and k.processed == proc
                   and spec.width(phase, k.batch, k.budget if phase is Phase.VERIFY else None) == W for k in keys)
    for phase in (Phase.CONTEXT, Phase.DECODE, Phase.DRAFT, Phase.VERIFY):
        on_drafter = phase in (Phase.CONTEXT, Phase.DRAFT) and drafter is not None
        cfg = drafter if on_drafter else target
        shards = 1 if on_drafter else world   # the target's heads and MLP rows split over the ranks
        widths = {b: phase_widths(spec, phase, b) for b in buckets}
        for W in sorted({w for ws in widths.values() for w in ws}, reverse=True):
            bs = tuple(b for b in buckets if W in widths[b])
            B = bs[-1]
            rows = B * (W - 1 if phase is Phase.DRAFT else W)
            # logits (fp32) with sort/noise temporaries + a few hidden-size activations per token
            per_row = 2 * 8 * (cfg.hidden_size + cfg.intermediate_size * 2 // shards)
            per_row += 0 if phase is Phase.CONTEXT else 4 * V * 4
            if phase is Phase.DRAFT and spec.method == "ddtree":
                per_row += 4 * V  # log-softmax for the tree build
            # attention scores over the longest KV bucket, fp32, for every query row of every head
            attn = 0 if phase is Phase.CONTEXT else 4 * B * W * cfg.num_heads // shards * kv_lengths[-1]
            est = 2 * rows * per_row + attn
            out.append(PlanEntry(phase, W, bs, tuple(kv_lengths), est, graphs=count(phase, W, False)))
            if phase in (Phase.DECODE, Phase.VERIFY) and pmodes:
                # processing: the biased / penalized / masked logits and their temporaries (about
                # five fp32 vocabulary rows per node), and the committed rows' fp64 normalizer
                extra = 2 * rows * 5 * V * 4 + 2 * B * spec.max_commit * V * 8
                out.append(PlanEntry(phase, W, bs, tuple(kv_lengths), est + extra, True, count(phase, W, True)))
    return out


def first_sets(batch_sizes: list[int], kv_lengths: list[int], modes: tuple[SampleMode, ...]) -> list[GraphSet]:
    """The sets that serve every round before the others are in (`RoundGraphs.capture`'s
    `first`): at each batch bucket, the most general mode (each mode's sampler gives the modes
    below it their own picks: `SampleMode`) at the shortest KV bucket and at the longest (a round
    may attend over more slots than it needs: the others are masked)."""
    top, short, long = max(modes), min(kv_lengths), max(kv_lengths)
    return sorted({GraphSet(B, top, L) for B in batch_sizes for L in (short, long)})


def set_keys(spec: SpecConfig, sets: list[GraphSet], drafter: bool, constrained: bool,
             processed: bool) -> set[GraphKey]:
    """The round graphs of these sets (a graph shared by several once)."""
    return {key_of(st, B, m, L) for B, m, L in sets
            for st in bucket_steps(spec, B, m, drafter and spec.speculative, constrained,
                                   processed and m in PROCESSED_MODES)}


def graph_keys(spec: SpecConfig, max_num_seqs: int, kv_lengths: list[int], modes: tuple[SampleMode, ...],
               drafter: bool, constrained: bool, processed: bool) -> set[GraphKey]:
    """The round graphs `RoundGraphs.capture` captures for these buckets and modes (with the
    constrained and the processed rounds' steps, as asked); needs no GPU."""
    return set_keys(spec, [GraphSet(B, m, L) for L in kv_lengths for B in batch_buckets(max_num_seqs) for m in modes],
                    drafter, constrained, processed)


def format_plan(plan: list[PlanEntry], modes: tuple[SampleMode, ...] = CAPTURED_MODES) -> str:
    lines = [f"{'phase':<10} {'width':>5}  {'batch sizes':<20} {'kv lengths':<26} {'graphs':>6} {'est. memory':>11}"]
    for e in plan:
        bs = ",".join(map(str, e.batch_sizes))
        kv = "any" if e.phase in LENGTHLESS else ",".join(map(str, e.kv_lengths))
        name = e.phase.value + ("+lp" if e.processed else "")
        lines.append(f"{name:<10} {e.width:>5}  {bs:<20} {kv:<26} {e.graphs:>6} {e.est_bytes / 2**20:>8.1f} MiB")
    names = ", ".join(m.name.lower() for m in modes)
    pnames = ", ".join(m.name.lower() for m in PROCESSED_MODES if m in modes)
    return "\n".join(lines + [
        f"{sum(e.graphs for e in plan)} graphs: decode and verify once per sampler mode ({names}), the drafter's "
        f"context and draft once for every mode, the context once for every kv length; a phase's row holds the "
        f"constrained round's steps too (structured output); +lp: the processed round's (log-probabilities, "
        f"penalties, logit_bias, banned tokens, min_p), in {pnames or 'no captured mode'}"])


class RoundGraphs:
    """One CUDA graph per (step, batch bucket, sampler mode, KV bucket), over the round context's
    buffers. The runner owns it (`ModelRunner.capture`)."""

    def __init__(self, rc: RoundContext, timer: PhaseTimer, batch_sizes: list[int], kv_lengths: list[int],
                 modes: tuple[SampleMode, ...], pages_per_row: int, constrained: bool = False,
                 processed: bool = False, later: tuple[bool, bool] = (False, False), warmups: int = 2) -> None:
        self.rc, self.timer = rc, timer
        self.warmups = warmups   # eager runs before each capture (`capture_graph`)
        self.constrained = constrained   # the constrained round's steps captured too
        self.processed = processed       # the processed round's steps too (in PROCESSED_MODES)
        # (constrained, processed) steps captured after `capture`, a graph at a time (`capture_next`)
        self.later = later
        self.pending: list[GraphSet] = []   # the sets `capture_next` has still to capture
        # sets whose graphs `recapture_next` captures again (their pieces compiled by then), and
        # the graphs it has captured so far (a graph shared by sets is captured once)
        self.upgrade: list[GraphSet] = []
        self._fresh: set[GraphKey] = set()
        self.started: list[GraphSet] = []   # the sets `capture` captured (all, or its `first`)
        self.stand_ins = 0                  # rounds that replayed another set's graphs (`replay`)
        self.batch_sizes, self.kv_lengths, self.modes = list(batch_sizes), list(kv_lengths), modes
        self.pages_per_row = pages_per_row
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.fallbacks = 0
        self._warned: set[tuple] = set()
        self.capture_seconds: dict[str, float] = {}   # host seconds per phase's captures, and their warm-up
        self.set_seconds: dict[GraphSet, float] = {}  # host seconds per graph set

    def keys(self) -> set[GraphKey]:
        return set(self.graphs)

    def steps(self, bucket: int, mode: SampleMode, later: bool = False) -> tuple[PhaseStep, ...]:
        """The steps a set captures (`later`: with those left for `capture_next`)."""
        rc = self.rc
        constrained, processed = self.constrained, self.processed
        if later:
            constrained, processed = constrained or self.later[0], processed or self.later[1]
        return bucket_steps(rc.spec, bucket, mode, rc.drafter is not None, constrained,
                            processed and mode in PROCESSED_MODES)

    def sets(self) -> list[GraphSet]:
        """What `capture` captures, in its order: the largest first (later, smaller graphs reuse
        the pool's memory)."""
        return [GraphSet(B, m, L) for L in reversed(self.kv_lengths) for B in reversed(self.batch_sizes)
                for m in self.modes]

    def first_sets(self) -> list[GraphSet]:
        """`first_sets` of these buckets and modes, in `sets`' order."""
        want = set(first_sets(self.batch_sizes, self.kv_lengths, self.modes))
        return [s for s in self.sets() if s in want]

    @torch.inference_mode()
    def capture(self, progress: Callable[[str], None] | None = None,
                first: list[GraphSet] | None = None) -> dict[str, float]:
        """Capture every step of every (bucket, mode, KV length), a graph shared by several of
        them once; leaves the round state as it found it. `first`: only those sets (`first_sets`);
        the others are left for `capture_next`, the shortest KV buckets and the smallest batches
        first, and a round of theirs replays a captured set meanwhile (`replay`). Returns host
        seconds per phase (and the warm-ups'); `set_seconds` keeps those of each graph set.
        `progress(text)` hears of each set as it starts."""
        rc = self.rc
        jobs = self.sets() if first is None else list(first)
        self.pool = torch.cuda.graph_pool_handle()
        saved = rc.state.snapshot()
        with collector_paused():
            for i, job in enumerate(jobs):
                if progress is not None:
                    progress(f"graph set {i + 1}/{len(jobs)} ({job.describe()}), {len(self.graphs)} graphs")
                t0 = time.perf_counter()
                self._capture_set(job, self.steps(job.batch, job.mode))
                self.set_seconds[job] = time.perf_counter() - t0
        rc.state.restore(saved)
        torch.cuda.synchronize()
        slow = sorted(self.set_seconds.items(), key=lambda kv: -kv[1])[:3]
        log.info("captured %d round graphs in %d sets (%.2f s); slowest sets: %s", len(self.graphs), len(jobs),
                 sum(self.set_seconds.values()), ", ".join(f"{k.describe()} {v:.2f} s" for k, v in slow))
        self.started = jobs
        rest = sorted(set(self.sets()) - set(jobs), key=lambda j: (j.kv_len, j.batch, j.mode))
        self.pending = rest + (jobs if any(self.later) else [])
        return dict(self.capture_seconds)

    def _capture_set(self, job: GraphSet, steps: tuple[PhaseStep, ...]) -> None:
        """Capture the steps of one (bucket, mode, KV length) not captured yet, a graph shared by
        several keys once."""
        rc, (B, mode, L) = self.rc, job
        check_widths(rc, steps, B, self.pages_per_row)
        for st in steps:
            key = key_of(st, B, mode, L)
            if key in self.graphs:
                continue
            self.graphs[key] = capture_graph(lambda st=st: st.run(rc, B, L, mode), self.pool,
                                             collectives=rc.target.tp is not None, warmups=self.warmups,
                                             reset=lambda: rc.state.park(0, B),
                                             seconds=self.capture_seconds, label=st.phase.value)

    def _capture_one(self, job: GraphSet, st: PhaseStep, queue: list[GraphSet], replace: bool = False) -> float:
        """Capture `st`'s graph of `job` while no request runs (its rows parked, the round state put
        back), in place of the one it has where `replace`; a failure empties `queue`, the work it
        was part of. Returns host seconds."""
        saved = self.rc.state.snapshot()
        t0 = time.perf_counter()
        try:
            with collector_paused():
                if replace:
                    self.graphs.pop(key_of(st, *job), None)   # dropped before its replacement is captured
                self._capture_set(job, (st,))
        except Exception:
            queue.clear()
            raise
        finally:
            self.rc.state.restore(saved)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    @torch.inference_mode()
    def recapture_next(self) -> bool:
        """Capture one graph of the first set in `upgrade` again, replacing the one captured at
        start-up; False once none is left. Run as `capture_next` is, while no request runs."""
        if not self.upgrade:
            return False
        job = self.upgrade[0]
        todo = [st for st in self.steps(job.batch, job.mode) if key_of(st, *job) not in self._fresh]
        if todo:
            # (on failure the rest would fail alike; a set whose graph is gone runs eagerly)
            self._capture_one(job, todo[0], self.upgrade, replace=True)
            self._fresh.add(key_of(todo[0], *job))
        if len(todo) <= 1:
            self.upgrade.pop(0)
        return True

    @torch.inference_mode()
    def capture_next(self) -> bool:
        """Capture one more graph of the first pending set (one `capture` left out, or the steps
        left for later, `later`) into the same pool; False once none is left. Run between engine
        steps while no request runs (its rows are parked and the round state put back as
        `capture` does), so that a server fills them in while idle: one graph a call, so that a
        request arriving meanwhile waits for one capture at most. A set stays pending until its
        last graph is in."""
        if not self.pending:
            return False
        job = self.pending[0]
        todo = [st for st in self.steps(job.batch, job.mode, later=True) if key_of(st, *job) not in self.graphs]
        if todo:   # (on failure the rest would fail alike: their rounds run eagerly)
            self.set_seconds[job] = self.set_seconds.get(job, 0.0) + self._capture_one(job, todo[0], self.pending)
        if len(todo) <= 1:
            self.pending.pop(0)
        if not self.pending:
            self.constrained, self.processed = self.constrained or self.later[0], self.processed or self.later[1]
            self.later = (False, False)
        return True

    def get(self, st: PhaseStep, bucket: int, mode: SampleMode, kv_len: int) -> torch.cuda.CUDAGraph | None:
        return self.graphs.get(key_of(st, bucket, mode, kv_len))

    def replay(self, b: int, mode: SampleMode, kv_len: int, steps: tuple[PhaseStep, ...]) -> bool:
        """Run one round (`steps`, from `ModelRunner.round_steps`) for rows 0..b-1 attending over
        kv_len cache slots, from graphs (another set's where its own is still to come: `_stand_in`);
        False if none fits (counted and warned once per shape, unless its set is still to come)."""
        B = self.bucket(b)
        graphs = [self.get(st, B, mode, kv_len) for st in steps]
        if any(g is None for g in graphs) and GraphSet(B, mode, kv_len) in self.pending:
            # its set is still to come (`capture_next`): a captured set that computes the same
            # picks stands in, else the round runs eagerly meanwhile, as planned
            graphs = self._stand_in(B, mode, kv_len, steps)
            if graphs is None:
                return False
            self.stand_ins += 1
        if any(g is None for g in graphs):
            self.fallbacks += 1
            if (b, mode, kv_len) not in self._warned:
                self._warned.add((b, mode, kv_len))
                log.warning("no CUDA graph for batch %d (phases %s, %s, kv length %d): running eagerly",
                            b, tuple((st.phase.value, st.width) for st in steps), mode.name, kv_len)
            return False
        self.rc.state.park(b, B)
        for st, g in zip(steps, graphs):
            with self.timer.phase(st.phase.value):
                g.replay()
        return True

    def _stand_in(self, B: int, mode: SampleMode, kv_len: int,
                  steps: tuple[PhaseStep, ...]) -> list[torch.cuda.CUDAGraph] | None:
        """The graphs of the round's steps in the nearest captured set of batch bucket B that
        computes its picks: the shortest KV bucket at least kv_len (the slots past a row's length
        are masked, as they are for every row shorter than the batch's longest), in the least
        general mode at least `mode`; None if no set has them all."""
        for L in sorted(self.kv_lengths):
            for m in sorted(self.modes):
                if L < kv_len or m < mode or (m, L) == (mode, kv_len):
                    continue
                graphs = [self.get(st, B, m, L) for st in steps]
                if all(g is not None for g in graphs):
                    return graphs
        return None

    def bucket(self, b: int) -> int:
        """The batch bucket rows 0..b-1 run at (the round context's, which the steps' widths follow)."""
        return batch_bucket(b, self.rc.max_num_seqs)
