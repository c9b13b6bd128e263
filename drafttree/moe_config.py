"""The mixture-of-experts and multi-head latent attention parts of a model's config.json
(Qwen3-MoE, DeepSeek-V3 and the models that declare it, such as Kimi K2)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int          # one routed expert's
    scoring: str                    # "softmax" (Qwen3-MoE) | "sigmoid" (DeepSeek-V3, noaux_tc)
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]  # the layers whose MLP is the MoE block; the others are dense
    n_group: int = 1                # sigmoid routing picks topk_group of n_group expert groups first
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    num_shared: int = 0             # shared experts, one MLP of num_shared * intermediate_size

    def __post_init__(self) -> None:
        assert self.scoring in ("softmax", "sigmoid"), self.scoring
        assert 1 <= self.top_k <= self.num_experts, (self.top_k, self.num_experts)
        assert self.num_experts % self.n_group == 0 and 1 <= self.topk_group <= self.n_group
        # a group's score is the sum of its two best experts
        assert self.n_group == 1 or self.num_experts // self.n_group >= 2
        assert self.top_k <= self.topk_group * self.num_experts // self.n_group


@dataclass(frozen=True)
class MLAConfig:
    q_lora_rank: int | None         # None: one q projection, no low-rank query
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool           # the rope half of q/k is laid out in pairs (x0, x1), (x2, x3)...
    softmax_scale: float            # (nope + rope)^-1/2, times yarn's mscale^2 where rope scaling says so

    @property
    def cache_dim(self) -> int:
        """One token's cache entry: the normed latent, then the roped shared key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def parse_mla(d: dict[str, Any], rope_scaling: dict[str, Any] | None) -> MLAConfig:
    nope, rope = int(d["qk_nope_head_dim"]), int(d["qk_rope_head_dim"])
    scale = (nope + rope) ** -0.5
    if rope_scaling and rope_scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(float(rope_scaling["factor"]), float(rope_scaling["mscale_all_dim"])) ** 2
    q_lora = d.get("q_lora_rank")
    return MLAConfig(None if q_lora is None else int(q_lora), int(d["kv_lora_rank"]), nope, rope,
                     int(d["v_head_dim"]), bool(d.get("rope_interleave", True)), scale)


def parse_moe(d: dict[str, Any], arch: str, num_layers: int) -> MoEConfig | None:
    """The MoE block of a Qwen3-MoE or DeepSeek-V3 config, None if no layer has one."""
    if arch == "qwen3_moe":
        E = int(d.get("num_experts") or d.get("num_local_experts") or 0)
        step = int(d.get("decoder_sparse_step", 1))
        dense = set(d.get("mlp_only_layers") or [])
        layers = tuple(i for i in range(num_layers) if E > 0 and i not in dense and (i + 1) % step == 0)
        if not layers:
            return None
        return MoEConfig(E, int(d["num_experts_per_tok"]), int(d["moe_intermediate_size"]), "softmax",
                         bool(d.get("norm_topk_prob", False)), layers)
    E = d.get("n_routed_experts") or d.get("num_local_experts")
    if not E:
        return None
    first, freq = int(d.get("first_k_dense_replace", 0)), int(d.get("moe_layer_freq", 1))
    layers = tuple(i for i in range(num_layers) if i >= first and i % freq == 0)
    if not layers:
        return None
    if d.get("topk_method", "noaux_tc") != "noaux_tc" or d.get("scoring_func", "sigmoid") != "sigmoid":
        raise ValueError(f"unsupported DeepSeek routing topk_method={d.get('topk_method')!r} "
                         f"scoring_func={d.get('scoring_func')!r} (supported: noaux_tc with sigmoid)")
    return MoEConfig(int(E), int(d["num_experts_per_tok"]), int(d["moe_intermediate_size"]), "sigmoid",
                     bool(d.get("norm_topk_prob", True)), layers, int(d.get("n_group") or 1),
                     int(d.get("topk_group") or 1), float(d.get("routed_scaling_factor", 1.0)),
                     int(d.get("n_shared_experts") or 0))
