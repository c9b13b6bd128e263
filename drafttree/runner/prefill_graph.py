"""CUDA graphs for prefill (on with CUDA graphs; `prefill_graphs=False`, `--no-prefill-graphs` to turn off).

An eager prefill of a small model is host-bound: on an H200, the SmolLM2 shape with a drafter
took 21–37 ms per prefill of 64–500 tokens for 0.9–1.7 ms of GPU work, and 1.7–3.4 ms graphed
(docs/performance.md). Here the forward over n prompts, padded to a
length bucket Pb (a power of two, at least MIN_LEN), is captured once per (n, Pb) at its first
use and replayed from static buffers: token ids, lengths and the requests' block tables.

Padding to Pb does what the eager path already does for prompts of unequal length: pad tokens
write K/V (and drafter context) past each prompt's end, into the request's own pages where the
cache stays masked until real tokens overwrite it, or into the null page. Only prefills whose
chunks all start at position 0 are graphed (a later chunk, or one after a prefix-cache hit, runs
eagerly). A batch of n * Pb > MAX_TOKENS runs as several graphed groups of
MAX_TOKENS // Pb prompts; a prompt longer than MAX_TOKENS stays eager (it is GPU-bound).
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from drafttree.runner.cuda_graph import collector_paused, warm_up
from drafttree.models.kv_cache import attn_meta, causal
from drafttree.kernels.triton_jit import next_pow2

MIN_LEN = 16
MAX_TOKENS = 2048
log = logging.getLogger(__name__)


@dataclass
class PrefillBuffers:
    ids: torch.Tensor               # [n, Pb] long, zero past each prompt
    lens: torch.Tensor              # [n] long
    block_table: torch.Tensor       # [n, P] long: the requests' pages
    h_last: torch.Tensor            # [n, D]: final hidden state at each prompt's last token
    a_last: torch.Tensor | None     # [n, F]: the drafter's features there


class PrefillGraphs:
    def __init__(self, runner, max_tokens: int = MAX_TOKENS) -> None:
        self.r = weakref.proxy(runner)   # owned by the runner, as GraphRunner
        self.max_tokens = min(max_tokens, runner.prefill_chunk)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, PrefillBuffers]] = {}
        self.pool = None
        self.failed = False   # a capture ran out of memory: prefill stays eager from then on

    def bucket(self, P: int) -> int | None:
        """The padded length of a graphed prefill of prompts of at most P tokens, or None."""
        Pb = max(MIN_LEN, next_pow2(P))
        return Pb if Pb <= self.max_tokens and Pb <= self.r.cache_cfg.max_len else None

    def forward_fn(self, buf: PrefillBuffers) -> Callable[[], None]:
        """The prefill forward over the buffers: what is captured, and what the warm-up runs."""
        r = self.r
        n, Pb = buf.ids.shape
        dev = buf.ids.device

        def run() -> None:
            pos = torch.arange(Pb, device=dev).expand(n, Pb)
            meta = attn_meta(torch.zeros(n, dtype=torch.long, device=dev), causal(n, Pb, dev), Pb,
                             block_table=buf.block_table, page_size=r.cache_cfg.page_size)
            dkv = (r.dkv.k, r.dkv.v) if r.drafter is not None else None
            h, f = r.prefill_forward(buf.ids, pos, meta, (r.kv.k, r.kv.v), dkv, buf.lens - 1)
            buf.h_last.copy_(h)
            if f is not None:
                buf.a_last.copy_(f)
        return run

    def run(self, ids: torch.Tensor, lens: torch.Tensor,
            table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Prefill ids [n, P] (zero-padded) through block tables `table` [n, pages] from graphs, in groups of
        at most max_tokens // Pb prompts; returns (h_last, a_last), or None if no bucket fits.
        For one group these are static buffers, valid until the next prefill."""
        n, P = ids.shape
        Pb = self.bucket(P)
        if Pb is None or self.failed:
            return None
        g = self.max_tokens // Pb
        try:
            if n <= g:
                return self._replay(ids, lens, table, Pb)
            # a later group may replay the same graph: copy each group's outputs before it does
            parts = [tuple(None if t is None else t.clone() for t in
                           self._replay(ids[a:a + g], lens[a:a + g], table[a:a + g], Pb)) for a in range(0, n, g)]
        except torch.cuda.OutOfMemoryError:   # the eager prefill then writes these pages again
            if self.r.target.tp is not None:
                raise   # the other ranks replay their graphs: an eager forward here would not meet them
            self.failed, self.graphs, self.pool = True, {}, None
            log.warning("out of memory capturing a prefill graph (%d prompts, %d tokens): prefill runs "
                        "eagerly from now on", min(n, g), Pb)
            return None
        h = torch.cat([p[0] for p in parts])
        return h, None if parts[0][1] is None else torch.cat([p[1] for p in parts])

    def _replay(self, ids: torch.Tensor, lens: torch.Tensor, table: torch.Tensor, Pb: int):
        n, P = ids.shape
        new = (n, Pb) not in self.graphs
        buf = self._buffers(n, Pb) if new else self.graphs[(n, Pb)][1]
        buf.ids.zero_()
        buf.ids[:, :P].copy_(ids)
        buf.lens.copy_(lens)
        buf.block_table.copy_(table)
        if new:   # the warm-up runs are real prefills of these pages: they write what the replay does
            self.graphs[(n, Pb)] = (self._capture(self.forward_fn(buf)), buf)
        self.graphs[(n, Pb)][0].replay()
        return buf.h_last, buf.a_last

    def _buffers(self, n: int, Pb: int) -> PrefillBuffers:
        r, dev = self.r, self.r.device
        feat = r.state.ctx_feat.shape[2]
        zeros = lambda *s: torch.zeros(*s, dtype=torch.long, device=dev)  # noqa: E731
        return PrefillBuffers(zeros(n, Pb), zeros(n), zeros(n, r.cache_cfg.pages_per_row),
                              torch.zeros(n, r.target.cfg.hidden_size, dtype=r.dtype, device=dev),
                              torch.zeros(n, feat, dtype=r.dtype, device=dev) if r.drafter is not None else None)

    def _capture(self, fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()   # apart from the rounds' pool
        warm_up(fn)
        if self.r.target.tp is not None:   # no collective of the warm-up in flight (as GraphRunner.capture)
            torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # captured while serving, at first use: CUDA calls of other threads stay allowed
        with collector_paused(), torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            fn()
        return graph
