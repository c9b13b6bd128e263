"""Qwen3-MoE and DeepSeek-V3 (Kimi K2) targets: `DecoderLM`'s forward over layers whose MLP may be
an MoE block (`moe.SparseMoE`) and whose attention may be MLA (`mla.MLAttention`).

Qwen3-MoE: Qwen3's attention (q/k norm, GQA); MoE in the layers `MoEConfig.sparse_layers` names
(decoder_sparse_step, mlp_only_layers), dense MLPs elsewhere. DeepSeek-V3: MLA; dense MLPs in the
first `first_k_dense_replace` layers (and off `moe_layer_freq`), MoE with shared experts after.
The layers run the torch ops (no fused projection kernels yet); the attention of Qwen3-MoE takes
the dense models' kernels where they run.
"""
from __future__ import annotations

import torch
from torch import nn

from drafttree.config import ModelConfig
from drafttree.models.decoder import DecoderLM
from drafttree.models.layers import MLP, Attention, AttnMeta, RMSNorm, Rotary
from drafttree.models.mla import MLAttention
from drafttree.models.moe import SparseMoE
from drafttree.models.rope import ScaledRotary
from drafttree.parallel.group import TPGroup
from drafttree.parallel.shard import unsupported_sparse


class SparseDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg) if cfg.mla is not None else Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        sparse = cfg.moe is not None and index in cfg.moe.sparse_layers
        self.mlp = SparseMoE(cfg.hidden_size, cfg.moe) if sparse else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None, rope, meta: AttnMeta, k_cache,
                v_cache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As `decoder.DecoderLayer.forward`: (the stream before this layer's MLP output, that
        output, the stream this layer took in)."""
        x, h = (x, self.input_layernorm(x)) if delta is None else self.input_layernorm.add_and_norm(x, delta)
        x_in = x
        x, h = self.post_attention_layernorm.add_and_norm(x, self.self_attn(h, rope, meta, k_cache, v_cache))
        return x, self.mlp(h), x_in


class SparseDecoderLM(DecoderLM):
    """`DecoderLM` (forward, logits, capture of hidden states for a drafter) over sparse layers."""

    def __init__(self, cfg: ModelConfig) -> None:
        nn.Module.__init__(self)   # not DecoderLM's: its dense layers are never built
        self.cfg, self.tp = cfg, None   # one device: tensor parallelism refuses sparse models
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(SparseDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = ScaledRotary(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight


def is_sparse(cfg: ModelConfig) -> bool:
    return cfg.sparse


def build_target(cfg: ModelConfig, tp: TPGroup | None = None) -> DecoderLM:
    """The target module for a config (on the current default device); over a tensor-parallel
    group `tp`, this rank's shards (dense models only: `parallel.shard.check_size` refuses the others)."""
    if not is_sparse(cfg):
        return DecoderLM(cfg, tp)
    if tp is not None:
        raise ValueError(unsupported_sparse(cfg))
    return SparseDecoderLM(cfg)


def build_rotary(cfg: ModelConfig) -> nn.Module:
    """The rotary tables of `build_target(cfg)` (rebuilt after loading onto a device)."""
    return ScaledRotary(cfg) if is_sparse(cfg) else Rotary(cfg)


def fp32_parameters(module: nn.Module, marker: str = ".mlp.router.") -> list[str]:
    """The parameters kept in fp32 whatever the model's dtype: the routers' (`marker` names them;
    "mlp.router." within one layer)."""
    return [n for n, _ in module.named_parameters() if marker in n]
