"""CUDA graphs for every phase of a round, each captured at its own width.

Every width comes from `SpecConfig.width(phase, batch)`; nothing here chooses a token count, and
capture checks that the buffers a graph reads and writes have those widths. Graphs read and
write the runner's persistent buffers (its `RoundContext`: state, KV caches), so a replay needs
no input copies. Rows between the real batch size and the bucket are parked first
(`RoundState.park`).
"""
from __future__ import annotations

import contextlib
import gc
import logging
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from tqdm import tqdm

from drafttree.config import ModelConfig
from drafttree.phases import Phase, SpecConfig, batch_buckets
from drafttree.sampling import SampleMode
from drafttree.spec_decode.rounds import context_phase, decode_round, draft_phase, verify_phase

log = logging.getLogger(__name__)

# Unfiltered sampling (top-p 1, the API default) has its own graphs: the filtered ones would give
# the same tokens but find every row's top-k / top-p threshold each round.
CAPTURED_MODES = (SampleMode.GREEDY, SampleMode.SAMPLE, SampleMode.FILTERED)


def warm_up(fn: Callable[[], object], times: int = 2) -> None:
    """Run fn on a side stream before capturing it: allocator, Triton compiles, cuBLAS picks."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(times):
            fn()
    torch.cuda.current_stream().wait_stream(side)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic collector runs first and then stays off while graphs are captured: objects
    it would free mid-capture (an earlier engine's tensors, events, pinned buffers) may make CUDA
    calls that a capture forbids, and the capture fails."""
    gc.collect()
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


@dataclass(frozen=True)
class PlanEntry:
    phase: Phase
    width: int              # tokens per request in this phase's forward
    batch_sizes: tuple[int, ...]
    kv_lengths: tuple[int, ...]   # attention lengths captured (KV buckets)
    est_bytes: int          # activation estimate for the largest batch and KV bucket


def graph_plan(spec: SpecConfig, target: ModelConfig, drafter: ModelConfig | None,
               max_num_seqs: int, kv_lengths: list[int], world: int = 1) -> list[PlanEntry]:
    """What `GraphRunner.capture` will capture on each rank of `world`; needs no GPU."""
    buckets = batch_buckets(max_num_seqs)
    out = []
    V = target.vocab_size
    for phase in (Phase.CONTEXT, Phase.DECODE, Phase.DRAFT, Phase.VERIFY):
        if phase is Phase.CONTEXT and not spec.speculative:
            continue
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
            out.append(PlanEntry(phase, W, bs, tuple(kv_lengths), 2 * rows * per_row + attn))
    return out


def phase_widths(spec: SpecConfig, phase: Phase, batch: int) -> set[int]:
    """The widths `phase` runs at over a batch bucket of `batch` rows, greedy or sampled: every
    bucket may decode (budget 0: the schedule, the choice or a request's cap), and verifies at
    each of its budgets."""
    budgets = {n for greedy in (True, False) for n in spec.budgets_at(batch, greedy) if n}
    if phase is Phase.VERIFY:
        return {spec.width(phase, batch, n) for n in budgets}
    if phase is Phase.DRAFT:
        return {spec.width(phase, batch)} if budgets else set()
    return {spec.width(phase, batch)}


def sampler_modes(names: tuple[str, ...] | None) -> tuple[SampleMode, ...]:
    """The sampler modes whose round graphs are captured (`EngineConfig.sampler_modes`)."""
    if names is None:
        return CAPTURED_MODES
    known = {m.name.lower(): m for m in CAPTURED_MODES}
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise ValueError(f"sampler_modes: {bad or 'none given'}; choose from {', '.join(known)}")
    return tuple(m for m in CAPTURED_MODES if m.name.lower() in names)


def format_plan(plan: list[PlanEntry], modes: tuple[SampleMode, ...] = CAPTURED_MODES) -> str:
    lines = [f"{'phase':<8} {'width':>5}  {'batch sizes':<20} {'kv lengths':<26} {'est. memory':>11}"]
    for e in plan:
        bs = ",".join(map(str, e.batch_sizes))
        kv = ",".join(map(str, e.kv_lengths))
        lines.append(f"{e.phase.value:<8} {e.width:>5}  {bs:<20} {kv:<26} {e.est_bytes / 2**20:>8.1f} MiB")
    names = ", ".join(m.name.lower() for m in modes)
    return "\n".join(lines + [f"each batch size is captured once per sampler mode ({names})"])


class GraphRunner:
    def __init__(self, runner, modes: tuple[SampleMode, ...] = CAPTURED_MODES) -> None:
        # The runner owns this (runner.graphs): a strong reference back would make a cycle that
        # only Python's cyclic collector frees, holding the KV cache and graphs after the engine
        # is dropped and freeing them at any moment, inside another engine's capture too.
        self.r = weakref.proxy(runner)
        self.spec: SpecConfig = runner.spec
        self.buckets = runner.cache_cfg.batch_buckets
        self.kv_buckets = runner.cache_cfg.kv_buckets
        self.modes = modes
        # (phase, batch bucket, sampler mode, KV length, budget: the verify's, else 0) -> graph
        self.graphs: dict[tuple[Phase, int, SampleMode, int, int], torch.cuda.CUDAGraph] = {}
        self.trees: dict[tuple[int, SampleMode, int], object] = {}   # draft outputs feeding verify graphs
        self.pool = None
        self.fallbacks = 0
        self._warned: set[tuple] = set()
        self.capture_seconds: dict[str, float] = {}   # host seconds per phase's captures, and their warm-up

    def plan(self) -> list[PlanEntry]:
        d = self.r.drafter.cfg.model if self.r.drafter is not None else None
        tp = self.r.target.tp
        return graph_plan(self.spec, self.r.target.cfg, d, self.r.cache_cfg.max_num_seqs, self.kv_buckets,
                          1 if tp is None else tp.world)

    def _phase_fns(self, B: int, mode: SampleMode, L: int) -> list[tuple[Phase, int, Callable[[], None]]]:
        """(phase, budget, function) for every graph of a set: the decode round (after the
        drafter's context write, with a drafter), the draft at the bucket's largest budget and a
        verify per budget of the bucket, each verifying the draft's first budget + 1 nodes."""
        # The runner's round context, looked up through the weak proxy when a phase runs: a
        # function kept past capture must not keep the runner's buffers alive.
        r = self.r
        out: list[tuple[Phase, int, Callable[[], None]]] = []
        if r.drafter is not None:
            out.append((Phase.CONTEXT, 0, lambda: context_phase(r.round_ctx, B)))
        out.append((Phase.DECODE, 0, lambda: decode_round(r.round_ctx, B, L, mode)))
        budgets = [n for n in self.spec.budgets_at(B, mode is SampleMode.GREEDY) if n]
        if not budgets:
            return out

        def draft() -> None:
            self.trees[(B, mode, L)] = draft_phase(r.round_ctx, B, L)

        def verify(n: int) -> Callable[[], None]:
            return lambda: verify_phase(r.round_ctx, B, L, self.trees[(B, mode, L)], mode, n)
        return out + [(Phase.DRAFT, 0, draft)] + [(Phase.VERIFY, n, verify(n)) for n in budgets]

    def check_widths(self, B: int, mode: SampleMode, L: int) -> None:
        """The static buffers a graph set for batch bucket B reads and writes have the widths
        `spec.width` gives (host-known shapes: no sync): pending drafter features and committed
        tokens per row, the block table's pages (max_model_len plus the widest round's writes), and
        the draft tree that feeds the verify graph."""
        r, s, spec = self.r, self.r.state, self.spec
        widths = {"pending features": (s.ctx_feat.shape[1], spec.width(Phase.CONTEXT, B)),
                  "committed tokens": (s.out_tokens.shape[1], spec.max_commit),
                  "block table pages": (s.block_table.shape[1],
                                        r.cache_cfg.pages_for(r.cache_cfg.max_model_len + spec.kv_headroom))}
        tree = self.trees.get((B, mode, L))
        if tree is not None:
            widths["draft tree"] = (tree.num_nodes, spec.width(Phase.VERIFY, B))
        bad = {k: v for k, v in widths.items() if v[0] != v[1]}
        assert not bad, f"batch bucket {B}: buffer widths (have, want) {bad}"

    @torch.inference_mode()
    def capture(self) -> None:
        jobs = [(B, m, L) for L in reversed(self.kv_buckets) for B in reversed(self.buckets) for m in self.modes]
        log.info("capturing CUDA graphs:\n%s", format_plan(self.plan(), self.modes))
        self.pool = torch.cuda.graph_pool_handle()
        snapshot = [t.clone() for t in self._state_tensors()]
        with collector_paused():
            self._capture_jobs(jobs)
        for t, saved in zip(self._state_tensors(), snapshot):
            t.copy_(saved)
        torch.cuda.synchronize()

    def _capture_jobs(self, jobs: list[tuple[int, SampleMode, int]]) -> None:
        secs = self.capture_seconds
        for B, mode, L in tqdm(jobs, desc="capturing CUDA graphs", unit="graph set"):
            self.r.state.park(0, B)
            fns = self._phase_fns(B, mode, L)

            def every_phase() -> None:
                for phase, _, fn in fns:
                    if phase is not Phase.DECODE:   # a decode round follows its context phase
                        self.r.state.park(0, B)
                    fn()
            t0 = time.perf_counter()
            warm_up(every_phase)
            secs["warm-up"] = secs.get("warm-up", 0.0) + time.perf_counter() - t0
            self.check_widths(B, mode, L)
            self.r.state.park(0, B)
            tp = self.r.target.tp is not None
            if tp:   # no collective of the warm-up still runs when a capture (with its own) starts
                torch.cuda.synchronize()
            for phase, budget, fn in fns:
                t0 = time.perf_counter()
                g = torch.cuda.CUDAGraph()
                # Tensor-parallel: NCCL's collectives are captured on this stream; its watchdog
                # thread may query events of earlier work meanwhile, which a global capture forbids.
                with torch.cuda.graph(g, pool=self.pool, capture_error_mode="thread_local" if tp else "global"):
                    fn()
                self.graphs[(phase, B, mode, L, budget)] = g
                secs[phase.value] = secs.get(phase.value, 0.0) + time.perf_counter() - t0

    def _state_tensors(self) -> list[torch.Tensor]:
        s = self.r.state
        return [s.start, s.bonus, s.ctx_n, s.ctx_feat, s.out, s.block_table]

    def bucket(self, b: int) -> int | None:
        return next((B for B in self.buckets if B >= b), None)

    def replay(self, b: int, mode: SampleMode, kv_len: int, phases: tuple[Phase, ...], budget: int = 0) -> bool:
        """Run one round (`phases`, from `ModelRunner.round_phases`, verifying at `budget`) for
        rows 0..b-1 attending over kv_len cache slots, from graphs; False (counted, warned once
        per shape) if none fits."""
        B = self.bucket(b)
        keys = [(p, B, mode, kv_len, budget if p is Phase.VERIFY else 0) for p in phases]
        if B is None or any(k not in self.graphs for k in keys):
            self.fallbacks += 1
            shape = tuple((p.value, self.spec.width(p, B or b, budget if p is Phase.VERIFY else None))
                          for p in phases)
            if (b, mode, kv_len) not in self._warned:
                self._warned.add((b, mode, kv_len))
                log.warning("no CUDA graph for batch %d (phases %s, %s, kv length %d): running eagerly",
                            b, shape, mode.name, kv_len)
            return False
        self.r.state.park(b, B)
        # a round's phases replay back to back: a verify graph reads the tree its job's draft graph
        # left in the shared pool, which any other graph's replay may reuse (`cost.measure` too)
        for k in keys:
            with self.r.timer.phase(k[0].value):
                self.graphs[k].replay()
        return True
