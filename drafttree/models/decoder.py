"""Decoder-only target model: Llama (incl. llama3 rope scaling, SmolLM2), Qwen2, Qwen3."""
from __future__ import annotations

import torch
from torch import nn

from drafttree.config import ModelConfig
from drafttree.kernels import dispatch
from drafttree.models.kv_cache import KVLayout
from drafttree.models.layers import MLP, Attention, AttnMeta, LMHead, RMSNorm, Rotary
from drafttree.models.quant import weight_scale
from drafttree.parallel.group import TPGroup
from drafttree.parallel.layers import VocabParallelEmbedding, VocabParallelHead


class DecoderLayer(nn.Module):
    """One layer; over `tp` its attention and MLP hold this rank's shards, and each ends in an
    all-reduce, so the residual stream is whole (and the same) on every rank."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, tp)

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None, rope, meta: AttnMeta, k_cache,
                v_cache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x is the residual stream before the previous layer's MLP output `delta` is added
        (None for the first layer): each residual add runs in the kernel of the norm after it.
        Returns (the stream before this layer's MLP output, that output, the stream this layer
        took in: x + delta, the previous layer's hidden state)."""
        if dispatch.projection_kernels(x):
            return self._fused(x, delta, rope, meta, k_cache, v_cache)
        x, h = (x, self.input_layernorm(x)) if delta is None else self.input_layernorm.add_and_norm(x, delta)
        return *self.mlp_after(x, self.self_attn(h, rope, meta, k_cache, v_cache), fused=False), x

    def _fused(self, x: torch.Tensor, delta: torch.Tensor | None, rope, meta: AttnMeta, k_cache,
               v_cache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`forward` for few token rows through the fused projections (`dispatch.norm_gemv`...): for
        one row, each norm runs inside the projection after it and SiLU·up inside the gate/up
        projection; a verify's or draft block's rows take tensor-core tiles or the torch ops, per
        weight class."""
        ln, attn = self.input_layernorm, self.self_attn
        x, qkv = dispatch.norm_gemv(x, delta, ln.weight, ln.eps, attn.qkv_proj.weight, attn.qkv_proj.bias)
        o = attn.reduce(dispatch.gemv(attn.attend_qkv(qkv, rope, meta, k_cache, v_cache), attn.o_proj.weight,
                                      attn.o_proj.bias))
        return *self.mlp_after(x, o, fused=True), x

    def mlp_after(self, x: torch.Tensor, attn_out: torch.Tensor, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + attn_out, the MLP's output on its norm): through the fused projections (the add and
        norm in the gate/up projection, SiLU·up its epilogue) if `fused`, else the torch ops."""
        post, mlp = self.post_attention_layernorm, self.mlp
        if fused:
            x, h = dispatch.norm_glu_gemv(x, attn_out, post.weight, post.eps, mlp.gate_up_proj.weight,
                                             weight_scale(mlp.gate_up_proj))
            return x, mlp.reduce(dispatch.gemv(h, mlp.down_proj.weight, None, weight_scale(mlp.down_proj)))
        x, h = post.add_and_norm(x, attn_out)
        return x, mlp(h)

    def residual_mlp(self, x: torch.Tensor, attn_out: torch.Tensor, fused: bool | None = None) -> torch.Tensor:
        """The layer after attention, residuals added at once: add, norm, MLP, add (`mlp_after`;
        `fused` unless given: whether x takes the fused projections)."""
        x, y = self.mlp_after(x, attn_out, dispatch.projection_kernels(x) if fused is None else fused)
        return x + y


def vocab_ends(cfg: ModelConfig, tp: TPGroup | None) -> tuple[nn.Module, nn.Module]:
    """(embedding, LM head): whole, or over `tp` this rank's vocabulary rows; tied where the model ties them."""
    V, D = cfg.vocab_size, cfg.hidden_size
    # given its weight, nn.Embedding draws no random one (on the meta device that draw alone
    # imports torch's compiler, about a second on a small CPU)
    embed = nn.Embedding(V, D, _weight=torch.empty(V, D)) if tp is None else VocabParallelEmbedding(V, D, tp)
    head = LMHead(D, V) if tp is None else VocabParallelHead(V, D, tp)
    if cfg.tie_word_embeddings:
        head.weight = embed.weight
    return embed, head


class DecoderLM(nn.Module):
    """The target. Over a tensor-parallel group `tp` (None: one device) every layer holds this
    rank's shards, and the embedding and LM head its vocabulary rows (`parallel.layers`); the
    hidden states and logits it returns are whole on every rank."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.embed_tokens, head = vocab_ends(cfg, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg)
        self.lm_head = head   # registered last: random weights are drawn in the parameters' order

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMeta,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                capture_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns the final-normed hidden states [B, W, D] and, if asked, the hidden states
        after each layer in `capture_layers`, concatenated: [B, W, len * D].

        k_cache / v_cache: [num_layers, rows, max_len, Hkv, hd].
        """
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions, x.dtype)
        captured = []
        last = len(self.layers) - 1
        delta = None
        for i, layer in enumerate(self.layers):
            x, delta, x_in = layer(x, delta, rope, meta, k_cache[i], v_cache[i])
            if i - 1 in capture_layers:   # layer i - 1's hidden state, summed by layer i's first kernel
                captured.append(x_in)
        x = self.norm.add_and_norm(x, delta)[1]
        if last in capture_layers:   # HF's hidden_states[-1] is taken after the final norm
            captured.append(x)
        aux = torch.cat(captured, dim=-1) if captured else None
        return x, aux

    @property
    def kv_layout(self) -> KVLayout:
        """What this rank's cache holds per token (its KV heads: `parallel.shard.kv_heads_per_rank`)."""
        return KVLayout.of(self.cfg) if self.tp is None else KVLayout.of(self.cfg, self.tp.world, self.tp.rank)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
