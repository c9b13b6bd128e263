"""CUDA graphs for prefill (on with CUDA graphs; `prefill_graphs=False`, `--no-prefill-graphs` to turn off).

An eager prefill of a small model is host-bound: on an H200, the SmolLM2 shape with a drafter
took 21–37 ms per prefill of 64–500 tokens for 0.9–1.7 ms of GPU work, and 1.7–3.4 ms graphed
(docs/performance.md). Here the forward over n prompts, padded to a
length bucket Pb (a power of two, at least MIN_LEN), is captured once per (n, Pb) and replayed
from static buffers: token ids, lengths and the cache rows the requests take. Every (n, Pb) the
engine can ask for (`prefill_shapes`, from the engine's own admission rule `prefill_fits`) is
captured at start-up, never on a request's path; a shape missing after all (an out-of-memory
capture) runs eagerly, which the engine's warm-up has run once.

Padding to Pb does what the eager path already does for prompts of unequal length: pad tokens
write K/V (and drafter context) past each prompt's end, where the cache stays masked until real
tokens overwrite it. A batch of n * Pb > MAX_TOKENS runs as several graphed groups of
MAX_TOKENS // Pb prompts; a prompt longer than MAX_TOKENS stays eager (it is GPU-bound).
"""
from __future__ import annotations

import dataclasses
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
Shape = tuple[int, int]   # (prompts, padded length) of one graphed prefill


def prefill_fits(n: int, longest: int, max_prefill_tokens: int) -> bool:
    """Whether n prompts of at most `longest` tokens go into one batched prefill: the engine's
    admission rule (one prompt always does)."""
    return n == 1 or n * longest <= max_prefill_tokens


def bucket_of(P: int, max_tokens: int, max_len: int) -> int | None:
    """The padded length of a graphed prefill of prompts of at most P tokens, or None (eager)."""
    Pb = max(MIN_LEN, next_pow2(P))
    return Pb if Pb <= max_tokens and Pb <= max_len else None


def group_shapes(n: int, P: int, max_tokens: int, max_len: int) -> list[Shape] | None:
    """The graphs a prefill of n prompts of at most P tokens replays, group by group (groups of
    max_tokens // Pb prompts), or None when it runs eagerly."""
    Pb = bucket_of(P, max_tokens, max_len)
    if Pb is None:
        return None
    g = max_tokens // Pb
    return [(min(g, n - a), Pb) for a in range(0, n, g)]


def prefill_shapes(max_num_seqs: int, max_prefill_tokens: int, max_prompt_len: int, max_tokens: int,
                   max_len: int) -> list[Shape]:
    """Every shape `group_shapes` can give for a prefill the engine admits: at most max_num_seqs
    prompts of 1 to max_prompt_len tokens that `prefill_fits`. Within a bucket the shortest
    length admits the most prompts, and any fewer are admitted too. Largest first."""
    out: set[Shape] = set()
    Pb = MIN_LEN
    while Pb <= min(max_tokens, max_len):
        shortest = 1 if Pb == MIN_LEN else Pb // 2 + 1
        if shortest > max_prompt_len:
            break
        for n in range(1, max_num_seqs + 1):
            if not prefill_fits(n, shortest, max_prefill_tokens):
                break
            out.update(group_shapes(n, shortest, max_tokens, max_len) or ())
        Pb *= 2
    return sorted(out, key=lambda s: (-s[0] * s[1], -s[1]))


@dataclass
class PrefillBuffers:
    ids: torch.Tensor               # [n, Pb] long, zero past each prompt
    lens: torch.Tensor              # [n] long
    rows: torch.Tensor              # [n, 1] long: the cache rows the prompts go to
    h_last: torch.Tensor            # [n, D]: final hidden state at each prompt's last token
    a_last: torch.Tensor | None     # [n, F]: the drafter's features there


class PrefillGraphs:
    def __init__(self, runner, max_prefill_tokens: int, max_tokens: int = MAX_TOKENS) -> None:
        self.r = weakref.proxy(runner)   # owned by the runner, as GraphRunner
        self.max_tokens = min(max_tokens, runner.prefill_chunk)
        self.max_prefill_tokens = max_prefill_tokens
        self.graphs: dict[Shape, tuple[torch.cuda.CUDAGraph, PrefillBuffers]] = {}
        self.pool = None
        self.failed = False   # a capture ran out of memory: prefill stays eager from then on
        self.fallbacks = 0    # graphable prefills that ran eagerly (a shape not captured)
        self._warned: set[Shape] = set()

    def bucket(self, P: int) -> int | None:
        """The padded length of a graphed prefill of prompts of at most P tokens, or None."""
        return bucket_of(P, self.max_tokens, self.r.cache_cfg.max_len)

    def shapes(self) -> list[Shape]:
        """What `capture` captures: every shape a prefill the engine admits can replay."""
        c = self.r.cache_cfg
        return prefill_shapes(c.max_num_seqs, self.max_prefill_tokens, c.max_model_len - 1, self.max_tokens,
                              c.max_len)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every shape before serving. Its warm-up runs are real prefills of rows 0..n-1,
        so this runs before any request holds a row. Out of memory: prefill stays eager."""
        shapes = self.shapes()
        log.info("capturing %d prefill graphs (prompts x padded length, up to %d tokens)", len(shapes),
                 self.max_tokens)
        try:
            with collector_paused():
                for n, Pb in shapes:
                    buf = self._buffers(n, Pb)
                    buf.lens.fill_(Pb)
                    buf.rows.copy_(torch.arange(n, device=buf.rows.device)[:, None])
                    self.graphs[(n, Pb)] = (self._capture(self.forward_fn(buf)), buf)
        except torch.cuda.OutOfMemoryError:
            self.failed, self.graphs, self.pool = True, {}, None
            log.warning("out of memory capturing a prefill graph (%d prompts, %d tokens): prefill runs "
                        "eagerly", n, Pb)

    def forward_fn(self, buf: PrefillBuffers) -> Callable[[], None]:
        """The prefill forward over the buffers: what is captured, and what the warm-up runs."""
        r = self.r
        n, Pb = buf.ids.shape
        dev = buf.ids.device

        def run() -> None:
            pos = torch.arange(Pb, device=dev).expand(n, Pb)
            meta = attn_meta(torch.zeros(n, dtype=torch.long, device=dev), causal(n, Pb, dev), Pb)
            meta = dataclasses.replace(meta, rows=buf.rows, gather_rows=True)
            dkv = (r.dkv.k, r.dkv.v) if r.drafter is not None else None
            h, f = r.prefill_forward(buf.ids, pos, meta, (r.kv.k, r.kv.v), dkv, buf.lens - 1)
            buf.h_last.copy_(h)
            if f is not None:
                buf.a_last.copy_(f)
        return run

    def run(self, first_row: int, ids: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Prefill ids [n, P] (zero-padded) into cache rows first_row.. from graphs, in groups of
        at most max_tokens // Pb prompts; returns (h_last, a_last), or None if no bucket fits.
        For one group these are static buffers, valid until the next prefill."""
        n, P = ids.shape
        shapes = group_shapes(n, P, self.max_tokens, self.r.cache_cfg.max_len)
        if shapes is None or self.failed:
            return None
        missing = [s for s in shapes if s not in self.graphs]
        if missing:   # never captured here, on a request's path: eager, as warmed at start-up
            self.fallbacks += 1
            if missing[0] not in self._warned:
                self._warned.add(missing[0])
                log.warning("no prefill graph for %d prompts x %d tokens: prefilling eagerly", *missing[0])
            return None
        Pb, g = shapes[0][1], shapes[0][0]
        if len(shapes) == 1:
            return self._replay(first_row, ids, lens, Pb)
        # a later group may replay the same graph: copy each group's outputs before it does
        parts = [tuple(None if t is None else t.clone() for t in
                       self._replay(first_row + a, ids[a:a + g], lens[a:a + g], Pb)) for a in range(0, n, g)]
        h = torch.cat([p[0] for p in parts])
        return h, None if parts[0][1] is None else torch.cat([p[1] for p in parts])

    def _replay(self, first_row: int, ids: torch.Tensor, lens: torch.Tensor, Pb: int):
        n, P = ids.shape
        graph, buf = self.graphs[(n, Pb)]
        buf.ids.zero_()
        buf.ids[:, :P].copy_(ids)
        buf.lens.copy_(lens)
        buf.rows.copy_(first_row + torch.arange(n, device=ids.device)[:, None])
        graph.replay()
        return buf.h_last, buf.a_last

    def _buffers(self, n: int, Pb: int) -> PrefillBuffers:
        r, dev = self.r, self.r.device
        feat = r.state.ctx_feat.shape[2]
        zeros = lambda *s: torch.zeros(*s, dtype=torch.long, device=dev)  # noqa: E731
        return PrefillBuffers(zeros(n, Pb), zeros(n), zeros(n, 1),
                              torch.zeros(n, r.target.cfg.hidden_size, dtype=r.dtype, device=dev),
                              torch.zeros(n, feat, dtype=r.dtype, device=dev) if r.drafter is not None else None)

    def _capture(self, fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()   # apart from the rounds' pool
        warm_up(fn)
        graph = torch.cuda.CUDAGraph()
        # a server's event loop runs in another thread meanwhile: its CUDA calls (none expected) stay allowed
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            fn()
        return graph
