"""CUDA graphs for prefill (on with CUDA graphs; `prefill_graphs=False`, `--no-prefill-graphs` to turn off).

An eager prefill of a small model is host-bound: on an H200, the SmolLM2 shape with a drafter
took 21–37 ms per prefill of 64–500 tokens for 0.9–1.7 ms of GPU work, and 1.7–3.4 ms graphed
(docs/performance.md). Here a prefill forward, its chunks grouped and padded to (row bucket,
length bucket, attention length) shapes as `prefill_plan.PrefillLimits.groups` says, replays
graphs from static buffers: token ids, start positions, lengths and the requests' block tables.
Every shape the scheduler's forwards can need (`PrefillLimits.shapes`, from the rule the
scheduler forms them by) is captured at start-up, never on a request's path. A forward that
needs a shape not captured (an out-of-memory capture) runs eagerly and is counted in
`fallbacks` (/metrics: drafttree_prefill_graph_fallbacks).

Forwards at an offset (the rest of a prompt after a prefix-cache hit: every chat request past
its template's first pages; a chunk continuing a long prompt) replay graphs too: positions
start + arange(Pb), attention over the L slots of the KV-length bucket that holds the forward's
reach, as the eager forward does at its tight length (masked slots past the reach add nothing).
Padding to Pb does what the eager path already does for prompts of unequal length: pad tokens
write K/V (and drafter context) past each chunk's end, into the request's own pages where the
cache stays masked until real tokens overwrite it, or into the null page; padding rows (start 0,
one token) have only the null page. Only chunks wider than the largest graph run eagerly (warmed
up at start-up by `engine.warmup`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from drafttree.models.kv_cache import NULL_PAGE, attn_meta, causal
from drafttree.runner.capture import capture_graph, collector_paused
from drafttree.runner.prefill_plan import PrefillLimits, Shape, at_offsets
from drafttree.spec_decode.rounds import prefill_forward
from drafttree.spec_decode.state import RoundContext

log = logging.getLogger(__name__)


@dataclass
class PrefillBuffers:
    ids: torch.Tensor               # [n, Pb] long, zero past each prompt
    start: torch.Tensor             # [n] long: each chunk's first position (0 on padding rows)
    lens: torch.Tensor              # [n] long
    block_table: torch.Tensor       # [n, P] long: the requests' pages (the null page's on padding rows)
    h_last: torch.Tensor            # [n, D]: final hidden state at each prompt's last token
    a_last: torch.Tensor | None     # [n, F]: the drafter's features there
    kv_len: int                     # L of the shape: 0 attends over the Pb new positions


class PrefillGraphs:
    """Prefill graphs over the round context's KV pools (the runner owns them: `ModelRunner.capture`)."""

    def __init__(self, rc: RoundContext, limits: PrefillLimits, pages_per_row: int) -> None:
        self.rc, self.limits, self.pages_per_row = rc, limits, pages_per_row
        self.graphs: dict[Shape, tuple[torch.cuda.CUDAGraph, PrefillBuffers]] = {}
        self.pool = None
        self.failed = False   # a capture ran out of memory: prefill stays eager from then on
        self.fallbacks = 0    # graphable prefills that ran eagerly (a shape not captured)
        self.pending: list[Shape] = []   # shapes left for `capture_next` (`capture(later=True)`)
        self._warned: set[Shape] = set()

    def widest(self) -> int:
        """The widest chunk a captured graph takes (0: none captured)."""
        return 0 if self.failed or not self.graphs else max(Pb for _, Pb, _ in self.graphs)

    def shapes(self) -> list[Shape]:
        """What `capture` captures: every shape a forward of the scheduler's can replay."""
        return self.limits.shapes()

    @torch.inference_mode()
    def capture(self, later: bool = False) -> None:
        """Capture every shape before serving, or with `later` leave them all to `capture_next`
        (a prefill of a pending shape runs eagerly meanwhile, not counted as a fallback). The
        warm-up runs and captures read and write the null page only (every row's block table is
        the null page's). Out of memory: prefill stays eager; tensor-parallel, the engine fails
        (every rank must replay alike)."""
        shapes = self.shapes()
        log.info("%s %d prefill graphs ((rows, padded length, attention length), up to %d tokens; %d at offsets)",
                 "leaving for later, while idle," if later else "capturing", len(shapes), self.limits.graph_tokens,
                 at_offsets(shapes))
        if later:
            self.pending = list(shapes)
            return
        with collector_paused():
            for shape in shapes:
                if not self._capture_shape(shape):
                    return

    @torch.inference_mode()
    def capture_next(self) -> bool:
        """Capture the first pending shape; False once none is left. Run while no request runs
        (its warm-up and capture touch the null page only), one graph a call, so that a request
        arriving meanwhile waits for one capture at most."""
        if not self.pending:
            return False
        if not self.graphs:
            # what eager prefills left cached in the allocator goes back first: the graphs' pool
            # takes what the start-up would have given it
            torch.cuda.empty_cache()
        try:
            with collector_paused():
                self._capture_shape(self.pending.pop(0))
        except Exception:
            self.pending.clear()   # the rest would fail alike: prefill eager for their shapes, counted
            raise
        return True

    def _capture_shape(self, shape: Shape) -> bool:
        """Capture one shape; False (prefill eager from now on, nothing pending) if memory ran out."""
        try:
            buf = self._buffers(*shape)
            buf.lens.fill_(shape[1])
            self.graphs[shape] = (self._capture(self.forward_fn(buf)), buf)
            return True
        except torch.cuda.OutOfMemoryError:
            if self.rc.target.tp is not None:
                raise   # the other ranks replay their graphs: an eager forward here would not meet them
            self.failed, self.graphs, self.pool, self.pending = True, {}, None, []
            log.warning("out of memory capturing a prefill graph (%d prompts, %d tokens, attention over %d): "
                        "prefill runs eagerly", *shape)
            return False

    def forward_fn(self, buf: PrefillBuffers) -> Callable[[], None]:
        """The prefill forward over the buffers: what is captured, and what the warm-up runs."""
        rc = self.rc
        n, Pb = buf.ids.shape
        dev = buf.ids.device
        L = buf.kv_len or Pb

        def run() -> None:   # as ModelRunner's eager prefill, at the shape's L
            pos = buf.start[:, None] + torch.arange(Pb, device=dev)
            meta = attn_meta(buf.start, causal(n, Pb, dev), L, block_table=buf.block_table, page_size=rc.page_size)
            h, f = prefill_forward(rc, buf.ids, pos, meta, buf.lens - 1)
            buf.h_last.copy_(h)
            if f is not None:
                buf.a_last.copy_(f)
        return run

    def run(self, ids: torch.Tensor, start: torch.Tensor, lens: torch.Tensor, table: torch.Tensor,
            reach: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Prefill ids [n, W] (zero-padded) at positions start[b].. through block tables `table`
        [n, pages] from graphs, group by group; `reach`: max(start + lens) when any chunk starts
        past 0, else 0 (host-known). Returns (h_last, a_last), or None to run eagerly. For one
        group these are views of static buffers, valid until the next prefill."""
        n, W = ids.shape
        groups = self.limits.groups(n, W, reach)
        if groups is None:   # wider than any graph: eager by design
            return None
        missing = [g.shape for g in groups if g.shape not in self.graphs]
        if missing and all(m in self.pending for m in missing):
            return None   # its graphs are still to come (`capture_next`): eager meanwhile, as planned
        if missing:   # never captured on a request's path: eager, as warmed at start-up, and counted
            self.fallbacks += 1
            if not self.failed and missing[0] not in self._warned:
                self._warned.add(missing[0])
                log.warning("no prefill graph for %d rows x %d tokens, attention over %d (not in the start-up "
                            "plan): prefilling eagerly", *missing[0])
            return None
        if len(groups) == 1:
            return self._replay(ids, start, lens, table, groups[0].shape)
        # a later group may replay the same graph: copy each group's outputs before it does
        parts = []
        for g in groups:
            s = slice(g.first, g.first + g.count)
            out = self._replay(ids[s], start[s], lens[s], table[s], g.shape)
            parts.append(tuple(None if t is None else t.clone() for t in out))
        h = torch.cat([p[0] for p in parts])
        return h, None if parts[0][1] is None else torch.cat([p[1] for p in parts])

    def _replay(self, ids: torch.Tensor, start: torch.Tensor, lens: torch.Tensor, table: torch.Tensor,
                shape: Shape):
        k, W = ids.shape
        graph, buf = self.graphs[shape]
        buf.ids.zero_()
        buf.ids[:k, :W].copy_(ids)
        buf.start[:k].copy_(start)
        buf.lens[:k].copy_(lens)
        buf.block_table[:k].copy_(table)
        if k < shape[0]:   # padding rows: one token each at position 0, into the null page
            buf.start[k:].zero_()
            buf.lens[k:].fill_(1)
            buf.block_table[k:].fill_(NULL_PAGE)
        graph.replay()
        return buf.h_last[:k], None if buf.a_last is None else buf.a_last[:k]

    def _buffers(self, n: int, Pb: int, L: int) -> PrefillBuffers:
        rc = self.rc
        feat, dtype, dev = rc.state.ctx_feat.shape[2], rc.state.ctx_feat.dtype, rc.state.start.device
        zeros = lambda *s: torch.zeros(*s, dtype=torch.long, device=dev)  # noqa: E731
        table = torch.full((n, self.pages_per_row), NULL_PAGE, dtype=torch.long, device=dev)
        return PrefillBuffers(zeros(n, Pb), zeros(n), zeros(n), table,
                              torch.zeros(n, rc.target.cfg.hidden_size, dtype=dtype, device=dev),
                              torch.zeros(n, feat, dtype=dtype, device=dev) if rc.drafter is not None else None, L)

    def _capture(self, fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()   # apart from the rounds' pool
        # a server's event loop runs in another thread meanwhile: its CUDA calls (none expected) stay allowed
        return capture_graph(fn, self.pool, collectives=self.rc.target.tp is not None, other_threads=True)
