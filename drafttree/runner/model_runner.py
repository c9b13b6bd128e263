"""Owns the models, the KV caches and the per-row device state; runs prefill and rounds."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from drafttree.config import ModelConfig
from drafttree.models.decoder import DecoderLM
from drafttree.models.dflash import DFlashDrafter
from drafttree.phases import SpecConfig
from drafttree.runner.kv_cache import KVCache, attn_meta, causal
from drafttree.runner.state import RoundState
from drafttree.sampling import SampleMode, SamplingParams, SamplingTensors, pick_tokens
from drafttree.spec.rounds import decode_round, spec_round

log = logging.getLogger(__name__)


@dataclass
class CacheConfig:
    max_num_seqs: int       # cache rows = the largest batch
    max_model_len: int      # prompt + generated tokens per request
    headroom: int           # extra slots a round writes past the committed length

    @property
    def max_len(self) -> int:
        return self.max_model_len + self.headroom


class ModelRunner:
    def __init__(self, target: DecoderLM, drafter: DFlashDrafter | None, spec: SpecConfig,
                 cache: CacheConfig, device: torch.device, dtype: torch.dtype) -> None:
        self.target, self.drafter, self.spec = target, drafter, spec
        self.cache_cfg, self.device, self.dtype = cache, device, dtype
        tc: ModelConfig = target.cfg
        rows, L = cache.max_num_seqs, cache.max_len
        self.kv = KVCache.allocate(tc.num_layers, rows, L, tc.num_kv_heads, tc.head_dim, dtype, device)
        self.capture_layers: tuple[int, ...] = ()
        feat = 0
        if drafter is not None:
            dc = drafter.cfg.model
            self.dkv = KVCache.allocate(dc.num_layers, rows, L, dc.num_kv_heads, dc.head_dim, dtype, device)
            self.capture_layers = drafter.cfg.target_layer_ids
            feat = len(self.capture_layers) * tc.hidden_size
        self.state = RoundState.allocate(rows, spec.max_commit, feat, dtype, device)
        self.graphs = None  # set by the engine when CUDA graphs are captured

    # -- prefill -----------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, row: int, prompt: list[int], params: SamplingParams, seed: int) -> None:
        """Run the prompt through the target in cache row `row`; sample the first token into
        state.bonus[row] (and state.out_tokens[row, 0])."""
        s, dev = self.state, self.device
        P = len(prompt)
        ids = torch.tensor([prompt], dtype=torch.long, device=dev)
        pos = torch.arange(P, device=dev)[None]
        zero = torch.zeros(1, dtype=torch.long, device=dev)
        meta = attn_meta(zero, causal(1, P, dev), P)
        kv_row = (self.kv.k[:, row:row + 1], self.kv.v[:, row:row + 1])
        hidden, aux = self.target(ids, pos, meta, *kv_row, self.capture_layers)
        s.sampling.set_row(row, params, seed)
        rs = slice(row, row + 1)
        st = SamplingTensors(s.sampling.temperature[rs], s.sampling.top_p[rs], s.sampling.top_k[rs],
                             s.sampling.seed[rs])
        tok = pick_tokens(self.target.logits(hidden[:, -1:]), st, pos[:, -1:] + 1, SampleMode.of([params]))[0, 0]
        s.start[row] = P
        s.bonus[row] = tok
        s.out_tokens[row, 0] = tok
        s.out_n[row] = 1
        if self.drafter is not None:
            s.ctx_feat[row, 0] = aux[0, -1]
            s.ctx_n[row] = 1
            if P > 1:
                self.drafter.write_context(aux[:, :-1], pos[:, :-1], self.dkv.k[:, row:row + 1],
                                           self.dkv.v[:, row:row + 1])

    # -- rounds ------------------------------------------------------------------------------
    @torch.inference_mode()
    def run_round(self, B: int, mode: SampleMode, max_length: int) -> None:
        """One round for rows 0..B-1; `max_length` bounds their committed lengths (host-known).

        With CUDA graphs, a batch no graph fits runs eagerly over the whole cache, the graphs'
        shapes, so both give the same tokens. Without graphs, attention covers only the used
        prefix of the cache, rounded up to 256 slots."""
        if self.graphs is not None:
            if not self.graphs.replay(B, mode):
                self.eager_round(B, self.cache_cfg.max_len, mode)
            return
        kv_len = min(-(-(max_length + self.spec.kv_headroom) // 256) * 256, self.cache_cfg.max_len)
        self.eager_round(B, kv_len, mode)

    def eager_round(self, B: int, kv_len: int, mode: SampleMode) -> None:
        if self.spec.speculative:
            spec_round(self, B, kv_len, mode)
        else:
            decode_round(self, B, kv_len, mode)

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Keep running requests packed in rows 0..B-1 when one finishes."""
        if src == dst:
            return
        n = min(length + self.spec.kv_headroom, self.cache_cfg.max_len)
        self.kv.move_row(src, dst, n)
        if self.drafter is not None:
            self.dkv.move_row(src, dst, n)
        self.state.copy_row(src, dst)
