"""DFlash2 drafter (`DFlash2DraftModel`), loading the published checkpoint format unchanged.

DFlash with two additions (docs/dflash2.md has the format and its sources):
- a grouped dynamic convolution around each layer's attention and MLP, along the draft block's
  positions (the anchor is position 0; the context vectors are not convolved);
- a candidate selector: the top K tokens of each drafted position and, between consecutive
  positions, edge scores S_i(p, c) = u_i(c) + <P[p] * H(h_i), Q[c]>, p the token chosen before.
The round turns the edges into a chain (the greedy walk) or a tree (`spec_decode.selector`).
"""
from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from drafttree.config import ModelConfig
from drafttree.kernels import dispatch
from drafttree.kernels.fused import fused
from drafttree.models.dflash import DFlashConfig, DFlashDrafter, DraftLayer, _fast_kernels
from drafttree.models.layers import AttnMeta

ARCHITECTURE = "DFlash2DraftModel"
# dflash_config fields: DFlash's, DFlash2's required four, and the optional ones the format reads
DFLASH_FIELDS = ("block_size", "mask_token_id", "target_layer_ids")
REQUIRED = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
OPTIONAL = ("input_embedding_scale", "output_multiplier", "final_logit_softcapping", "causal")
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass
class DFlash2Config(DFlashConfig):
    conv_kernel_size: int = 2          # taps: offsets 0 .. k-1 within the block
    conv_group_size: int = 16          # channels sharing one dynamic coefficient
    selector_rank: int = 256
    selector_top_k: int = 16           # candidates per drafted position
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    logit_softcap: float | None = None
    sliding_window: int | None = None  # every layer's attention window; None: full attention
    causal: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in REQUIRED:
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ValueError(f"dflash_config.{name} must be a positive integer, got {v!r}")
        if self.model.hidden_size % self.conv_group_size:
            raise ValueError(f"dflash_config.conv_group_size {self.conv_group_size} must divide hidden_size "
                             f"{self.model.hidden_size}")
        if self.selector_top_k > self.model.vocab_size:
            raise ValueError(f"dflash_config.selector_top_k {self.selector_top_k} exceeds vocab_size "
                             f"{self.model.vocab_size}")
        for name in ("input_embedding_scale", "output_multiplier"):
            if not _is_real(getattr(self, name)):
                raise ValueError(f"dflash_config.{name} must be a finite number, got {getattr(self, name)!r}")
        if self.logit_softcap is not None and not (_is_real(self.logit_softcap) and self.logit_softcap > 0):
            raise ValueError(f"dflash_config.final_logit_softcapping must be a positive number (or 0 / null: off), "
                             f"got {self.logit_softcap!r}")
        if self.sliding_window is not None and (not _is_int(self.sliding_window) or self.sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive integer, got {self.sliding_window!r}")

    @property
    def conv_groups(self) -> int:
        return self.model.hidden_size // self.conv_group_size

    @classmethod
    def from_dir(cls, path: str | Path) -> "DFlash2Config":
        base = DFlashConfig.from_dir(path)
        d = json.loads((Path(path) / "config.json").read_text())
        return cls.from_dict(d, base, Path(path) / "config.json")

    @classmethod
    def from_dict(cls, d: dict[str, Any], base: DFlashConfig, where: Path | str = "config.json") -> "DFlash2Config":
        """DFlash2's fields of config.json `d` on top of its DFlash fields `base`; a dflash_config
        field drafttree does not read is refused by name, never ignored."""
        if ARCHITECTURE not in (d.get("architectures") or []):
            raise ValueError(f"{where}: a DFlash2 drafter declares architectures [{ARCHITECTURE!r}], "
                             f"got {d.get('architectures')}")
        dc = d.get("dflash_config") or {}
        unknown = sorted(set(dc) - set(DFLASH_FIELDS + REQUIRED + OPTIONAL))
        if unknown:
            raise ValueError(f"{where}: dflash_config.{unknown[0]} is not a DFlash2 field drafttree reads "
                             f"(it reads {', '.join(DFLASH_FIELDS + REQUIRED + OPTIONAL)})")
        missing = [n for n in REQUIRED if n not in dc]
        if missing:
            raise ValueError(f"{where}: a DFlash2 config needs dflash_config.{missing[0]}")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{where}: hidden_act {act!r}: the drafter's MLP is SiLU-gated")
        window, causal = _attention(d, dc, base.model.num_layers, where)
        cap = dc.get("final_logit_softcapping")
        return cls(**{f.name: getattr(base, f.name) for f in fields(DFlashConfig)},
                   **{n: dc[n] for n in REQUIRED},
                   input_embedding_scale=dc.get("input_embedding_scale", 1.0),
                   output_multiplier=dc.get("output_multiplier", 1.0),
                   logit_softcap=None if cap in (None, 0, 0.0) else cap, sliding_window=window, causal=causal)


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _attention(d: dict[str, Any], dc: dict[str, Any], layers: int, where: Path | str) -> tuple[int | None, bool]:
    """(window or None, causal) of the draft attention, as the published format resolves them:
    layer_types (else Qwen3's use_sliding_window from max_window_layers on), and causality from
    is_causal, else dflash_config.causal, else sliding layers are causal. Every layer alike."""
    types = d.get("layer_types")
    if types is None:
        first = d.get("max_window_layers", 0) if d.get("use_sliding_window") else layers
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or any(t not in LAYER_TYPES for t in types):
        raise ValueError(f"{where}: layer_types must list one of {LAYER_TYPES} per layer ({layers}), got {types!r}")
    if len(set(types)) > 1:
        raise ValueError(f"{where}: layer_types mixes full and sliding attention; drafttree's drafter runs every "
                         "layer over one mask")
    sliding = types[0] == "sliding_attention"
    window = d.get("sliding_window") if sliding else None
    if sliding and window is None:
        raise ValueError(f"{where}: sliding_attention layers need sliding_window")
    causal = d.get("is_causal")
    if causal is None:
        causal = dc.get("causal")
    if causal is None:
        causal = sliding
    if not isinstance(causal, bool):
        raise ValueError(f"{where}: is_causal / dflash_config.causal must be true or false, got {causal!r}")
    return window, causal


def drafter_config(path: str | Path) -> DFlashConfig:
    """The drafter config of a checkpoint directory: DFlash2's for `DFlash2DraftModel`, else DFlash's."""
    f = Path(path) / "config.json"
    if f.is_file():
        try:
            archs = json.loads(f.read_text()).get("architectures") or []
        except (json.JSONDecodeError, AttributeError):
            archs = []
        if ARCHITECTURE in archs:
            return DFlash2Config.from_dir(path)
    return DFlashConfig.from_dir(path)


class BlockConv(nn.Module):
    """Grouped dynamic depthwise convolution along a block's positions, one per sublayer:
    `prepare` convolves the sublayer's input and returns the output side's coefficients,
    `finish` convolves its output with them. out[i, c] = sum_t (base[side, t, c] + delta[i, t,
    group(c)]) * x[i - t, c], x[j] = 0 before the block's start."""

    def __init__(self, hidden: int, taps: int, group: int) -> None:
        super().__init__()
        self.taps, self.group, self.groups = taps, group, hidden // group
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * taps * self.groups, bias=False)

    def reset_identity(self) -> None:
        """The identity: base tap 0 is one, every other tap and the projection zero."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., bs, D] -> (x convolved, the output side's coefficients [..., bs, taps, G])."""
        k = self.kernel_projection(x).unflatten(-1, (2, self.taps, self.groups))
        return self.convolve(x, k[..., 0, :, :], 0), k[..., 1, :, :]

    def finish(self, x: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
        return self.convolve(x, coef, 1)

    def convolve(self, x: torch.Tensor, delta: torch.Tensor, side: int) -> torch.Tensor:
        return block_convolve(x, self.base_kernel[side], delta, self.groups, self.taps)


@fused
def block_convolve(x: torch.Tensor, base: torch.Tensor, delta: torch.Tensor, groups: int, taps: int) -> torch.Tensor:
    """x [..., bs, D] convolved along bs with base [taps, D] + delta [..., bs, taps, groups] (a
    coefficient per channel group): a dozen elementwise ops a call, four calls a layer, hence one
    compiled piece."""
    bs = x.shape[-2]
    xg = x.unflatten(-1, (groups, -1))                                    # [..., bs, G, g]
    base = base.to(x.dtype).unflatten(-1, (groups, -1))
    out = None
    for t in range(min(taps, bs)):   # taps past the block's width see only zeros
        shifted = xg if t == 0 else F.pad(xg[..., :bs - t, :, :], (0, 0, 0, 0, t, 0))
        term = (base[t] + delta[..., t, :, None].to(x.dtype)) * shifted
        out = term if out is None else out + term
    return out.flatten(-2)


class DFlash2Layer(DraftLayer):
    """A draft layer whose attention and MLP each sit between the two halves of a `BlockConv`."""

    def __init__(self, cfg: ModelConfig, conv: tuple[int, int]) -> None:
        super().__init__(cfg)
        self.attention_conv = BlockConv(cfg.hidden_size, *conv)
        self.mlp_conv = BlockConv(cfg.hidden_size, *conv)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, rope_q, rope_kv, meta: AttnMeta,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        h, coef = self.attention_conv.prepare(self.input_layernorm(x))
        o = self.attend_block(self.self_attn.qkv_proj(h), ctx, rope_q, rope_kv, meta, k_cache, v_cache, False)
        x = x + self.attention_conv.finish(o, coef)
        h, coef = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), coef)


class CandidateSelector(nn.Module):
    """Predecessor and successor codebooks [V, r] and the hidden projection [r, D]."""

    def __init__(self, hidden: int, vocab: int, rank: int) -> None:
        super().__init__()
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab, rank))
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)

    def edges(self, hidden: torch.Tensor, unary: torch.Tensor, cand: torch.Tensor,
              pred: torch.Tensor) -> torch.Tensor:
        """Edge scores [..., Kp, Kc] in float32: unary [..., Kc] plus the bilinear term between
        each predecessor pred [..., Kp] and candidate cand [..., Kc] at hidden [..., D]."""
        return selector_edges(self.hidden_projection(hidden), unary, self.predecessor_codebook,
                              self.successor_codebook, cand, pred)


@fused
def selector_edges(h: torch.Tensor, unary: torch.Tensor, predecessors: torch.Tensor, successors: torch.Tensor,
                   cand: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
    """`CandidateSelector.edges` past the hidden projection h [..., r]."""
    p = predecessors[pred].float() * h.float()[..., None, :]
    q = successors[cand].float()
    return unary[..., None, :] + p @ q.transpose(-1, -2)


class DFlash2Drafter(DFlashDrafter):
    cfg: DFlash2Config

    def __init__(self, cfg: DFlash2Config, embed: nn.Embedding | None = None,
                 lm_head: nn.Linear | None = None) -> None:
        super().__init__(cfg, embed, lm_head)
        self.candidate_selector = CandidateSelector(cfg.model.hidden_size, cfg.model.vocab_size, cfg.selector_rank)

    def make_layer(self, m: ModelConfig) -> DFlash2Layer:
        return DFlash2Layer(m, (self.cfg.conv_kernel_size, self.cfg.conv_group_size))

    @_fast_kernels
    def forward(self, block_ids: torch.Tensor, block_pos: torch.Tensor, ctx_feat: torch.Tensor,
                ctx_pos: torch.Tensor, meta: AttnMeta, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        """As `DFlashDrafter.forward`, the embeddings scaled and the mask narrowed to the window
        (and causality) the checkpoint declares."""
        x = self.embed(block_ids)
        if self.cfg.input_embedding_scale != 1.0:
            x = x * self.cfg.input_embedding_scale
        return self.run_layers(x, block_pos, ctx_feat, ctx_pos, self.block_meta(meta, block_pos), k_cache, v_cache)

    def block_meta(self, meta: AttnMeta, block_pos: torch.Tensor) -> AttnMeta:
        """meta with its mask narrowed to the declared window and causality (logical positions:
        the block's queries at block_pos [B, bs], keys at 0 .. kv_len - 1)."""
        cfg = self.cfg
        if cfg.sliding_window is None and not cfg.causal:
            return meta
        key = torch.arange(meta.kv_len, device=block_pos.device)[None, None, :]
        rel = block_pos[:, :, None] - key                                  # query - key, [B, bs, L]
        keep = torch.ones_like(rel, dtype=torch.bool)
        if cfg.causal:
            keep &= rel >= 0
        if cfg.sliding_window is not None:
            keep &= (rel < cfg.sliding_window) & (rel > -cfg.sliding_window)
        return AttnMeta(meta.slots, meta.mask & keep[:, None], meta.rows, meta.kv_slots, meta.positions)

    @_fast_kernels
    def draft_logits(self, hidden: torch.Tensor, depth: int | None = None) -> torch.Tensor:
        """The unary logits of block positions 1..depth, [B, depth, V] float32: the LM head's,
        times output_multiplier, softcapped where the checkpoint says."""
        logits = super().draft_logits(hidden, depth)
        if self.cfg.output_multiplier != 1.0:
            logits = logits * self.cfg.output_multiplier
        if self.cfg.logit_softcap is not None:
            logits = torch.tanh(logits / self.cfg.logit_softcap) * self.cfg.logit_softcap
        return logits

    @_fast_kernels
    def edge_scores(self, hidden: torch.Tensor, anchor: torch.Tensor, depth: int,
                    logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The candidates of block positions 1..depth, [B, depth, K] (descending unary), and the
        edge scores [B, depth, K, K] (float32): scores[b, i, p, c] for candidate c at position
        i + 1 after candidate p at position i (position 0: the anchor [B], every row alike). The
        unary term is the candidates' log-probability, the published logit less a constant per
        position: no walk and no softmax over candidates tells them apart. `logits`: the block's
        `draft_logits`, where the caller has them already."""
        if logits is None:
            logits = self.draft_logits(hidden, depth)
        lp, cand = dispatch.top_log_probs(logits, self.cfg.selector_top_k)
        B, D, K = cand.shape
        pred = torch.cat([anchor.long()[:, None, None].expand(B, 1, K), cand[:, :-1]], dim=1)
        return cand, self.candidate_selector.edges(hidden[:, 1:1 + D], lp, cand, pred)
