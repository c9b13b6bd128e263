"""Owns the models, the KV caches and the per-row device state (one `RoundContext`, which the
round functions and their CUDA graphs take); runs prefill and rounds."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from drafttree.config import ModelConfig
from drafttree.models.decoder import DecoderLM
from drafttree.models.dflash import DFlashDrafter
from drafttree.models.kv_cache import KVCache, attn_meta, causal
from drafttree.phases import Phase, SpecConfig, batch_bucket, batch_buckets
from drafttree.runner.phase_timer import PhaseTimer
from drafttree.sampling import SampleMode, SamplingParams, SamplingTensors, pick_tokens
from drafttree.spec.rounds import context_phase, decode_round, draft_phase, verify_phase
from drafttree.spec.state import RoundContext, RoundState


@dataclass
class CacheConfig:
    max_num_seqs: int       # cache rows = the largest batch
    max_model_len: int      # prompt + generated tokens per request
    headroom: int           # extra slots a round writes past the committed length (spec.kv_headroom)

    @property
    def max_len(self) -> int:
        return self.max_model_len + self.headroom

    @property
    def kv_buckets(self) -> list[int]:
        """Attention lengths rounds run at (graphs are captured for each): 1024 * 4^i, capped."""
        out, n = [], 1024
        while n < self.max_len:
            out.append(n)
            n *= 4
        return out + [self.max_len]

    @property
    def batch_buckets(self) -> list[int]:
        return batch_buckets(self.max_num_seqs)

    def batch_bucket(self, b: int) -> int:
        return batch_bucket(b, self.max_num_seqs)

    def kv_bucket(self, needed: int) -> int:
        return next(n for n in self.kv_buckets if n >= min(needed, self.max_len))

    def kv_tight(self, needed: int) -> int:
        """Attention length for CPU rounds without a graph runner: the next multiple of 128, so attention
        does not sweep a mostly-masked 1024-slot bucket. On CUDA, eager rounds keep the buckets,
        so a graph and its eager fallback run the same shapes."""
        return min(-(-needed // 128) * 128, self.max_len)


class ModelRunner:
    def __init__(self, target: DecoderLM, drafter: DFlashDrafter | None, spec: SpecConfig,
                 cache: CacheConfig, device: torch.device, dtype: torch.dtype, prefill_chunk: int = 2048) -> None:
        self.prefill_chunk = prefill_chunk
        self.cache_cfg, self.device, self.dtype = cache, device, dtype
        tc: ModelConfig = target.cfg
        rows, L = cache.max_num_seqs, cache.max_len
        if cache.headroom != spec.kv_headroom:
            raise ValueError(f"cache headroom {cache.headroom} != spec.kv_headroom {spec.kv_headroom}")
        kv = KVCache.allocate(tc.num_layers, rows, L, tc.num_kv_heads, tc.head_dim, dtype, device, tc.v_cache_dim)
        dkv, capture_layers, feat = None, (), 0
        if drafter is not None:
            dc = drafter.cfg.model
            dkv = KVCache.allocate(dc.num_layers, rows, L, dc.num_kv_heads, dc.head_dim, dtype, device)
            capture_layers = drafter.cfg.target_layer_ids
            feat = len(capture_layers) * tc.hidden_size
        # pending drafter features: what one context phase writes, at most what a verify commits
        state = RoundState.allocate(rows, spec.width(Phase.CONTEXT), feat, dtype, device)
        self.round_ctx = RoundContext(target, drafter, spec, state, kv, dkv, capture_layers, rows)
        # Host-side bound on any row's pending drafter features (state.ctx_n), kept without a
        # sync: a verify leaves at most max_commit, a decode step adds one, a context phase
        # leaves one (its decode step's). Prefill and parking set 1, within any bound.
        self.ctx_bound = 1
        self.graphs = None  # set by the engine when CUDA graphs are captured
        self.prefill_graphs = None   # a PrefillGraphs, when the engine is asked for them
        self.timer = PhaseTimer(torch.device(device))

    # What the rounds work on, read through the one RoundContext (graphs captured over it).
    @property
    def target(self) -> DecoderLM:
        return self.round_ctx.target

    @property
    def drafter(self) -> DFlashDrafter | None:
        return self.round_ctx.drafter

    @property
    def spec(self) -> SpecConfig:
        return self.round_ctx.spec

    @property
    def state(self) -> RoundState:
        return self.round_ctx.state

    @property
    def kv(self) -> KVCache:
        return self.round_ctx.kv

    @property
    def dkv(self) -> KVCache | None:
        return self.round_ctx.dkv

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.round_ctx.capture_layers

    # -- prefill -----------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, first_row: int, prompts: list[list[int]], params: list[SamplingParams],
                seeds: list[int]) -> list[int]:
        """Prefill requests into cache rows first_row, first_row+1, ... together, padded to the
        longest prompt and run in chunks of `prefill_chunk` tokens; sample each first token into
        state.bonus. Returns the first tokens (the prefill's one host sync). Padding writes K/V
        only past each prompt's end, where the cache is masked until real tokens overwrite it."""
        s, dev = self.state, self.device
        n = len(prompts)
        lens = torch.tensor([len(p) for p in prompts], device=dev)
        P = max(len(p) for p in prompts)
        ids = torch.tensor([p + [0] * (P - len(p)) for p in prompts], dtype=torch.long, device=dev)
        rows = slice(first_row, first_row + n)
        with self.timer.phase("prefill"):
            graphed = self.prefill_graphs.run(first_row, ids, lens) if self.prefill_graphs is not None else None
            h_last, a_last = graphed if graphed is not None else self._prefill_chunks(ids, lens, rows)
        for i in range(n):
            s.sampling.set_row(first_row + i, params[i], seeds[i])
        st = SamplingTensors(s.sampling.temperature[rows], s.sampling.top_p[rows], s.sampling.top_k[rows],
                             s.sampling.seed[rows])
        logits = self.target.logits(h_last[:, None])
        tok = pick_tokens(logits, st, lens[:, None], SampleMode.of(params))[:, 0]
        s.start[rows] = lens
        s.bonus[rows] = tok
        s.out_tokens[rows, 0] = tok
        s.out_n[rows] = 1
        if a_last is not None:
            s.ctx_feat[rows, 0] = a_last.to(s.ctx_feat.dtype)
            s.ctx_n[rows] = 1
        return tok.tolist()

    def _prefill_chunks(self, ids: torch.Tensor, lens: torch.Tensor, rows: slice):
        """Run the padded prompts in chunks into cache rows `rows` (each chunk sees the cache its
        predecessors wrote); return the final hidden state and the drafter features at each
        prompt's last token."""
        n, P = ids.shape
        dev = ids.device
        pos = torch.arange(P, device=dev).expand(n, P)
        kv = (self.kv.k[:, rows], self.kv.v[:, rows])
        dkv = (self.dkv.k[:, rows], self.dkv.v[:, rows]) if self.drafter is not None else None
        last = lens - 1
        h_last = a_last = None
        for a in range(0, P, self.prefill_chunk):
            b = min(P, a + self.prefill_chunk)
            meta = attn_meta(torch.full((n,), a, device=dev), causal(n, b - a, dev), b)
            here = ((last >= a) & (last < b))[:, None]
            h, f = self.prefill_forward(ids[:, a:b], pos[:, a:b], meta, kv, dkv, (last - a).clamp(0, b - a - 1))
            h_last = h if h_last is None else torch.where(here, h, h_last)
            if f is not None:
                a_last = f if a_last is None else torch.where(here, f, a_last)
        return h_last, a_last

    def prefill_forward(self, ids: torch.Tensor, pos: torch.Tensor, meta, kv, dkv, at: torch.Tensor):
        """One prefill forward of the target over [n, W] tokens, the drafter's context written
        from it (when dkv); returns the hidden state and the drafter features at column at[b]
        of each row. Features past a prompt's end are padding, written where the cache is masked."""
        hidden, aux = self.target(ids, pos, meta, *kv, self.capture_layers)
        rows = torch.arange(ids.shape[0], device=ids.device)
        if dkv is None:
            return hidden[rows, at], None
        self.drafter.write_context(aux, pos, *dkv, rows=meta.rows if meta.gather_rows else None)
        return hidden[rows, at], aux[rows, at]

    # -- rounds ------------------------------------------------------------------------------
    @torch.inference_mode()
    def run_round(self, B: int, mode: SampleMode, max_length: int) -> None:
        """One round for rows 0..B-1; `max_length` bounds their committed lengths (host-known).
        Attention covers the smallest KV bucket that holds what the round writes; a batch no
        graph fits runs eagerly at the same shapes, so both give the same tokens."""
        if max_length > self.cache_cfg.max_model_len:
            # its writes would pass the row's end (max_model_len + headroom slots)
            raise RuntimeError(f"a round over rows of up to {max_length} committed tokens; the cache holds "
                               f"{self.cache_cfg.max_model_len} per row")
        kv_len = self.round_kv_len(max_length)
        phases = self.round_phases(B, mode)
        if self.graphs is None or not self.graphs.replay(B, mode, kv_len, phases):
            self.eager_round(B, kv_len, mode, phases)
        if self.drafter is not None:
            self.ctx_bound = (self.spec.max_commit if Phase.VERIFY in phases
                              else 1 if Phase.CONTEXT in phases else self.ctx_bound + 1)

    def round_phases(self, B: int, mode: SampleMode) -> tuple[Phase, ...]:
        """The phases of the next round over rows 0..B-1: draft and verify, or a decode step,
        after a context phase when a row's pending drafter features could fill their buffer."""
        phases = self.spec.phases_at(self.cache_cfg.batch_bucket(B), mode is SampleMode.GREEDY)
        if phases == (Phase.DECODE,) and self.drafter is not None and self.ctx_bound >= self.spec.max_commit:
            return (Phase.CONTEXT, Phase.DECODE)
        return phases

    def round_kv_len(self, max_length: int) -> int:
        """Attention length of a round over rows whose committed lengths are <= max_length."""
        needed = max_length + self.spec.kv_headroom
        tight = self.graphs is None and self.device.type == "cpu"
        return self.cache_cfg.kv_tight(needed) if tight else self.cache_cfg.kv_bucket(needed)

    def eager_round(self, B: int, kv_len: int, mode: SampleMode, phases: tuple[Phase, ...]) -> None:
        if Phase.CONTEXT in phases:
            with self.timer.phase("context"):
                context_phase(self.round_ctx, B)
        if Phase.DECODE in phases:
            with self.timer.phase("decode"):
                decode_round(self.round_ctx, B, kv_len, mode)
            return
        with self.timer.phase("draft"):
            tree = draft_phase(self.round_ctx, B, kv_len)
        with self.timer.phase("verify"):
            verify_phase(self.round_ctx, B, kv_len, tree, mode)

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Keep running requests packed in rows 0..B-1 when one finishes. `length`: the committed
        tokens the host knows of; an unread round's commits (at most max_commit <= kv_headroom
        more) lie within the slots moved."""
        if src == dst:
            return
        n = min(length + self.spec.kv_headroom, self.cache_cfg.max_len)
        self.kv.move_row(src, dst, n)
        if self.drafter is not None:
            self.dkv.move_row(src, dst, n)
        self.state.copy_row(src, dst)
