"""Qwen3-MoE and DeepSeek-V3 (Kimi K2) targets: `DecoderLM`'s forward over layers whose MLP may be
an MoE block (`moe.SparseMoE`) and whose attention may be MLA (`mla.MLAttention`).

Qwen3-MoE: Qwen3's attention (q/k norm, GQA); MoE in the layers `MoEConfig.sparse_layers` names
(decoder_sparse_step, mlp_only_layers), dense MLPs elsewhere. DeepSeek-V3: MLA; dense MLPs in the
first `first_k_dense_replace` layers (and off `moe_layer_freq`), MoE with shared experts after.
The layers run the torch ops (no fused projection kernels yet); the attention of Qwen3-MoE takes
the dense models' kernels where they run. Over a tensor-parallel group, the attention and dense
MLPs shard as the dense models' (MLA by heads), the MoE blocks by experts (`parallel.shard`).
"""
from __future__ import annotations

import torch
from torch import nn

from drafttree.config import ModelConfig
from drafttree.models.decoder import DecoderLM, vocab_ends
from drafttree.models.layers import MLP, Attention, AttnMeta, RMSNorm, Rotary
from drafttree.models.mla import MLAttention
from drafttree.models.moe import SparseMoE
from drafttree.models.rope import ScaledRotary
from drafttree.parallel.group import TPGroup


class SparseDecoderLayer(nn.Module):
    """One layer; over `tp`, as `decoder.DecoderLayer`, its attention and MLP (or MoE block) each
    end in an all-reduce, so the residual stream is whole and the same on every rank."""

    def __init__(self, cfg: ModelConfig, index: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg, tp) if cfg.mla is not None else Attention(cfg, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        sparse = cfg.moe is not None and index in cfg.moe.sparse_layers
        self.mlp = (SparseMoE(cfg.hidden_size, cfg.moe, tp) if sparse
                    else MLP(cfg.hidden_size, cfg.intermediate_size, tp))

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None, rope, meta: AttnMeta, k_cache,
                v_cache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As `decoder.DecoderLayer.forward`: (the stream before this layer's MLP output, that
        output, the stream this layer took in)."""
        x, h = (x, self.input_layernorm(x)) if delta is None else self.input_layernorm.add_and_norm(x, delta)
        x_in = x
        x, h = self.post_attention_layernorm.add_and_norm(x, self.self_attn(h, rope, meta, k_cache, v_cache))
        return x, self.mlp(h), x_in


class SparseDecoderLM(DecoderLM):
    """`DecoderLM` (forward, logits, capture of hidden states for a drafter, the KV layout) over
    sparse layers; over `tp`, this rank's shards and vocabulary rows."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None) -> None:
        nn.Module.__init__(self)   # not DecoderLM's: its dense layers are never built
        self.cfg, self.tp = cfg, tp
        self.embed_tokens, head = vocab_ends(cfg, tp)
        self.layers = nn.ModuleList(SparseDecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = ScaledRotary(cfg)
        self.lm_head = head   # registered last: random weights are drawn in the parameters' order


def build_target(cfg: ModelConfig, tp: TPGroup | None = None) -> DecoderLM:
    """The target module for a config (on the current default device); over a tensor-parallel
    group `tp`, this rank's shards (`parallel.shard.check_size` has accepted its size)."""
    return SparseDecoderLM(cfg, tp) if cfg.sparse else DecoderLM(cfg, tp)


def build_rotary(cfg: ModelConfig) -> nn.Module:
    """The rotary tables of `build_target(cfg)` (rebuilt after loading onto a device)."""
    return ScaledRotary(cfg) if cfg.sparse else Rotary(cfg)


def fp32_parameters(module: nn.Module, marker: str = ".mlp.router.") -> list[str]:
    """The parameters kept in fp32 whatever the model's dtype: the routers' (`marker` names them;
    "mlp.router." within one layer)."""
    return [n for n, _ in module.named_parameters() if marker in n]
