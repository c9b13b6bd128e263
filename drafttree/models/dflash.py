"""DFlash block-diffusion drafter, loading the published checkpoint format unchanged.

Context features (target hidden states after `target_layer_ids`, concatenated) go through
`fc` + `hidden_norm` into one vector per committed token; every draft layer projects them with
its own k/v projections and attends from the block to [context ; block] non-causally.
The drafter borrows the target's embedding and LM head (references, not copies).
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from drafttree.config import ModelConfig
from drafttree.kernels import dispatch
from drafttree.kernels.torch_ops import apply_rope
from drafttree.models.decoder import DecoderLayer
from drafttree.models.layers import AttnMeta, RMSNorm, Rotary, attend, cached_attention
from drafttree.models.quant import weight_scale
from drafttree.phases import SpecConfig
from drafttree.settings import current, using


def _is_schedule(value: object) -> bool:
    if not isinstance(value, str):
        return False
    try:
        SpecConfig.parse_schedule(value)
    except ValueError:
        return False
    return True


def default_target_layer_ids(num_layers: int, n: int) -> list[int]:
    """n layer ids spread over [1, L-3]: round(1 + i*(L-4)/(n-1)), halves rounded away from the
    middle so the set is symmetric (30 layers, n=5: [1, 7, 14, 21, 27]); then made strictly
    increasing inside [0, L-1]."""
    if not 1 <= n <= num_layers:
        raise ValueError(f"cannot pick {n} distinct target layers out of {num_layers}")
    if n == 1:
        return [num_layers // 2]
    lo, hi = 1.0, float(num_layers - 3)
    mid = (lo + hi) / 2
    raw = []
    for i in range(n):
        x = lo + i * (hi - lo) / (n - 1)
        raw.append(math.floor(x + 0.5) if x >= mid else math.ceil(x - 0.5))
    ids = sorted(min(max(r, 0), num_layers - 1) for r in raw)
    for i in range(1, n):
        ids[i] = max(ids[i], ids[i - 1] + 1)
    for i in range(n - 1, -1, -1):
        ids[i] = min(ids[i], num_layers - n + i)
        if i + 1 < n:
            ids[i] = min(ids[i], ids[i + 1] - 1)
    return ids


@dataclass
class DFlashConfig:
    model: ModelConfig
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None
    default_budget: int | None = None   # the DDTree budget measured fastest for this pair, if known
    default_schedule: str | None = None  # likewise its budget schedule under load ('16:0'), if known
    default_sampled: bool | None = None  # whether sampled (T > 0) rounds should speculate, if measured

    def __post_init__(self) -> None:
        if self.block_size < 2:   # a block is the anchor and at least one drafted position
            raise ValueError(f"block_size must be at least 2 (the anchor and a drafted position), "
                             f"got {self.block_size}")

    @classmethod
    def from_dir(cls, path: str | Path) -> "DFlashConfig":
        f = Path(path) / "config.json"
        if not f.is_file():
            raise FileNotFoundError(f"{f} not found: a drafter directory needs config.json")
        d = json.loads(f.read_text())
        if "DFlashDraftModel" not in (d.get("architectures") or []) and "dflash_config" not in d:
            raise ValueError(f"{path} is not a DFlash drafter (architectures={d.get('architectures')})")
        dc = d.get("dflash_config") or {}
        bs = d.get("block_size", dc.get("block_size"))
        if bs is None or "mask_token_id" not in dc or "target_layer_ids" not in dc:
            raise ValueError(f"{f}: a DFlash config needs block_size and dflash_config.mask_token_id "
                             "and dflash_config.target_layer_ids")
        ids = tuple(int(i) for i in dc["target_layer_ids"])
        if list(ids) != sorted(set(ids)):
            raise ValueError(f"{f}: target_layer_ids must be strictly increasing, got {list(ids)}")
        model = ModelConfig.from_dict({**d, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"})
        budget = d.get("ddtree_default_budget")
        if budget is not None and (type(budget) is not int or budget < 1):
            raise ValueError(f"{f}: ddtree_default_budget must be a positive integer, got {budget!r}")
        schedule = d.get("ddtree_default_budget_schedule")
        if schedule is not None and not _is_schedule(schedule):
            raise ValueError(f"{f}: ddtree_default_budget_schedule must be 'batch:budget,...', got {schedule!r}")
        sampled = d.get("ddtree_default_speculate_sampled")
        if sampled is not None and type(sampled) is not bool:
            raise ValueError(f"{f}: ddtree_default_speculate_sampled must be true or false, got {sampled!r}")
        return cls(model, int(bs), int(dc["mask_token_id"]), ids, d.get("num_target_layers"), budget, schedule,
                   sampled)

    def check_fits(self, target: ModelConfig) -> None:
        """Refuse a drafter that cannot work with this target, naming the mismatch."""
        m = self.model
        problems = []
        if m.hidden_size != target.hidden_size:
            problems.append(f"hidden size {m.hidden_size} != target's {target.hidden_size}")
        if m.vocab_size != target.vocab_size:
            problems.append(f"vocab size {m.vocab_size} != target's {target.vocab_size}")
        if not 0 <= self.mask_token_id < target.vocab_size:
            problems.append(f"mask_token_id {self.mask_token_id} outside the target's {target.vocab_size} rows")
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_layers]
        if bad:
            problems.append(f"target_layer_ids {bad} not in [0, {target.num_layers})")
        if self.num_target_layers is not None and self.num_target_layers != target.num_layers:
            problems.append(f"trained for {self.num_target_layers} target layers, target has {target.num_layers}")
        if problems:
            raise ValueError("drafter does not fit the target: " + "; ".join(problems))


class DraftLayer(DecoderLayer):
    """A decoder layer whose keys/values also come from the context vectors."""

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, rope_q, rope_kv, meta: AttnMeta,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        attn, ln = self.self_attn, self.input_layernorm
        fused = dispatch.projection_kernels(x)   # the block's rows: the norm inside the QKV projection
        if fused:
            qkv = dispatch.norm_gemv(x, None, ln.weight, ln.eps, attn.qkv_proj.weight, attn.qkv_proj.bias,
                                     weight_scale(attn.qkv_proj))[1]
        else:
            qkv = attn.qkv_proj(ln(x))
        return self.residual_mlp(x, self.attend_block(qkv, ctx, rope_q, rope_kv, meta, k_cache, v_cache, fused),
                                 fused)

    def attend_block(self, qkv: torch.Tensor, ctx: torch.Tensor, rope_q, rope_kv, meta: AttnMeta,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, fused: bool) -> torch.Tensor:
        """The attention output (o-projected) of the block's QKV rows over [context ; block]."""
        attn = self.self_attn
        qkv_ctx = attn.qkv_proj(ctx)          # the context vector is not layer-normed here
        if rope_q is None:   # the attention kernels' path (DFlashDrafter.forward decides)
            out = self._attend_kernel(torch.cat([qkv_ctx, qkv], dim=1), rope_kv, meta, k_cache, v_cache)
        else:
            q, kb, vb = attn.split_qkv(qkv)
            _, kc, vc = attn.split_qkv(qkv_ctx)
            k = apply_rope(torch.cat([kc, kb], dim=1), *rope_kv)
            v = torch.cat([vc, vb], dim=1)
            out = cached_attention(apply_rope(q, *rope_q), k, v, meta, k_cache, v_cache)
        return (dispatch.gemv(out, attn.o_proj.weight, attn.o_proj.bias, weight_scale(attn.o_proj)) if fused
                else attn.o_proj(out))

    def _attend_kernel(self, qkv: torch.Tensor, rope_kv, meta: AttnMeta, k_cache: torch.Tensor,
                       v_cache: torch.Tensor) -> torch.Tensor:
        """Attention from the QKV rows [context ; block]: q/k norm, rope and the K/V write of
        every row in one launch (`rope_kernel`), then the block's queries (the last rows; the
        context's are computed and dropped) over the cache."""
        attn = self.self_attn
        norm = attn.q_norm is not None
        qw, kw = (attn.q_norm.weight, attn.k_norm.weight) if norm else (None, None)
        q = dispatch.qk_rope_write_kv(qkv, attn.h, attn.hkv, qw, kw, attn.q_norm.eps if norm else 0.0, *rope_kv,
                                      k_cache, v_cache, meta.rows, meta.slots)
        return attend(q[:, q.shape[1] - meta.mask.shape[2]:], meta, k_cache, v_cache)


def _fast_kernels(method):
    """Run `method` with deterministic mode's kernels off. Every committed token is the target's
    own choice at its position (argmax, or its logits with the position's seeded noise), so the
    drafter's numerics decide how many tokens a round accepts, never which: it keeps the fast
    kernels, and the mode's cost stays on the target."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        if not current().deterministic:
            return method(self, *args, **kwargs)
        with using(deterministic=False):
            return method(self, *args, **kwargs)
    return run


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DFlashConfig, embed: nn.Embedding | None = None,
                 lm_head: nn.Linear | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        m = cfg.model
        self.fc = nn.Linear(len(cfg.target_layer_ids) * m.hidden_size, m.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        self.layers = nn.ModuleList(self.make_layer(m) for _ in range(m.num_layers))
        self.norm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        self.rotary = Rotary(m)
        self.borrow(embed, lm_head)

    def make_layer(self, m: ModelConfig) -> DraftLayer:
        return DraftLayer(m)

    def borrow(self, embed: nn.Embedding | None, lm_head: nn.Linear | None) -> "DFlashDrafter":
        """Use the target's embedding and LM head: plain attributes, not submodules, so they stay
        out of state_dict and are never copied."""
        self.__dict__["embed"] = embed
        self.__dict__["lm_head"] = lm_head
        return self

    def context(self, features: torch.Tensor) -> torch.Tensor:
        return self.hidden_norm(self.fc(features))

    @_fast_kernels
    def forward(self, block_ids: torch.Tensor, block_pos: torch.Tensor, ctx_feat: torch.Tensor,
                ctx_pos: torch.Tensor, meta: AttnMeta, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        """block_ids/block_pos [B, bs]; ctx_feat [B, C, n*D] (raw target features), ctx_pos [B, C].
        meta.slots must be cat(ctx slots, block slots). Returns final-normed hidden [B, bs, D]."""
        return self.run_layers(self.embed(block_ids), block_pos, ctx_feat, ctx_pos, meta, k_cache, v_cache)

    def run_layers(self, x: torch.Tensor, block_pos: torch.Tensor, ctx_feat: torch.Tensor, ctx_pos: torch.Tensor,
                   meta: AttnMeta, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """`forward` from the block's embeddings x [B, bs, D]."""
        ctx = self.context(ctx_feat.to(x.dtype))
        rope_kv = self.rotary(torch.cat([ctx_pos, block_pos], dim=1), x.dtype)
        kernels = dispatch.attention_kernels(x, self.cfg.model.head_dim)
        rope_q = None if kernels else self.rotary(block_pos, x.dtype)   # the kernels take it from rope_kv
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx, rope_q, rope_kv, meta, k_cache[i], v_cache[i])
        return self.norm(x)

    @_fast_kernels
    def write_context(self, ctx_feat: torch.Tensor, ctx_pos: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slots: torch.Tensor | None = None,
                      rows: torch.Tensor | None = None) -> None:
        """Project context features [B, C, F] at positions ctx_pos [B, C] into the cache only (no
        queries): after prefill, and in decode rounds without speculation. K/V go to
        cache[rows[b], :, slots[b, i]]; by default rows 0..B-1 and slot = position (a cache row
        per request; a paged cache passes its slot mapping and row 0)."""
        ctx = self.context(ctx_feat.to(self.norm.weight.dtype))
        cos, sin = self.rotary(ctx_pos, ctx.dtype)
        if rows is None:
            rows = torch.arange(ctx.shape[0], device=ctx.device)[:, None]
        slots = ctx_pos if slots is None else slots
        for i, layer in enumerate(self.layers):
            _, k, v = layer.self_attn.project(ctx)
            dispatch.write_kv(k_cache[i], v_cache[i], rows, slots, apply_rope(k, cos, sin), v)

    @_fast_kernels
    def draft_logits(self, hidden: torch.Tensor, depth: int | None = None) -> torch.Tensor:
        """Block positions 1..depth (default bs-1) predict the tokens at those same positions:
        [B, depth, V]; through the fp8 copy of the LM head if the drafter has one (`quant`)."""
        head = self.__dict__.get("draft_head")
        rows = hidden[:, 1:None if depth is None else 1 + depth]
        # one [B * depth, D] product: the strided slice would make the head a batched product over
        # B copies of its weight, read B times (4.6 ms of a 6.7 ms draft at batch 16, Qwen3-8B)
        flat = rows.reshape(-1, rows.shape[-1])
        return (self.lm_head if head is None else head)(flat).float().view(*rows.shape[:2], -1)
