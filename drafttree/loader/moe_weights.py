"""Qwen3-MoE and DeepSeek-V3 checkpoints (the Hugging Face layout: one tensor per expert) into
`models.moe_decoder.SparseDecoderLM`: experts stacked into [E, ...] tensors, gate and up fused.
A tensor-parallel rank stacks its own experts only (`parallel.shard.expert_span`); the others'
tensors are never read. Weights stored quantized stay so through the fusing and stacking where
their forms agree (`packed`); routers, norms and MLA's kv_b_proj come widened."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Callable

import torch

from drafttree.config import ModelConfig
from drafttree.loader.packed import Weight, cat_rows, dense, same_form, stack

StateDict = dict[str, Weight]
Take = Callable[[str], Weight]

MLA_TENSORS = ("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
               "kv_b_proj", "o_proj")


def layer_tensors(src: Mapping[str, Weight], cfg: ModelConfig, i: int, take: Take,
                  experts: range | None = None) -> StateDict:
    """Layer i's tensors under our names, relative to the layer, from HF names without the 'model.'
    prefix (`src`, read lazily); anything the config does not ask for (DeepSeek's
    multi-token-prediction layers, `experts` other than those given: all by default) is never read."""
    p = f"layers.{i}."
    out = {n + ".weight": dense(take(p + n + ".weight")) for n in ("input_layernorm", "post_attention_layernorm")}
    out.update(mla_tensors(src, p + "self_attn.") if cfg.mla is not None else
               attention_tensors(src, p + "self_attn.", take))
    if cfg.moe is not None and i in cfg.moe.sparse_layers:
        out.update(moe_tensors(src, p + "mlp.", range(cfg.moe.num_experts) if experts is None else experts, take))
    else:
        out.update(mlp_tensors(p + "mlp.", take))
    return {k.removeprefix(p): v for k, v in out.items()}


def attention_tensors(src: Mapping[str, Weight], a: str, take: Take) -> StateDict:
    out = {a + "qkv_proj.weight": cat_rows([take(a + f"{n}_proj.weight") for n in "qkv"]),
           a + "o_proj.weight": take(a + "o_proj.weight")}
    if a + "q_proj.bias" in src:
        out[a + "qkv_proj.bias"] = torch.cat([take(a + f"{n}_proj.bias") for n in "qkv"])
    for n in ("q_norm", "k_norm"):
        if a + n + ".weight" in src:
            out[a + n + ".weight"] = src[a + n + ".weight"]
    return out


def mla_tensors(src: Mapping[str, Weight], a: str) -> StateDict:
    """MLA keeps the checkpoint's names (the module checks that the ones its config needs exist).
    kv_b_proj comes widened: the absorbed attention uses it as a matrix, not as a projection."""
    out = {a + n + "." + kind: src[a + n + "." + kind] for n in MLA_TENSORS for kind in ("weight", "bias")
           if a + n + "." + kind in src}
    if a + "kv_b_proj.weight" in out:
        out[a + "kv_b_proj.weight"] = dense(out[a + "kv_b_proj.weight"])
    return out


def mlp_tensors(m: str, take: Take) -> StateDict:
    return {m + "gate_up_proj.weight": cat_rows([take(m + "gate_proj.weight"), take(m + "up_proj.weight")]),
            m + "down_proj.weight": take(m + "down_proj.weight")}


def moe_tensors(src: Mapping[str, Weight], m: str, experts: range, take: Take) -> StateDict:
    """Router, `experts` stacked [E, 2I, D] and [E, D, I], shared experts. Also reads experts saved
    already stacked (transformers' in-memory layout: experts.gate_up_proj, experts.down_proj; `src`
    slices them)."""
    out = {m + "router.weight": dense(take(m + "gate.weight"))}
    if m + "gate.e_score_correction_bias" in src:
        out[m + "router.bias"] = src[m + "gate.e_score_correction_bias"]
    e = m + "experts."
    if e + "gate_up_proj" in src:
        out[m + "experts.gate_up"], out[m + "experts.down"] = take(e + "gate_up_proj"), take(e + "down_proj")
    else:
        gate_up = stack([cat_rows([take(f"{e}{j}.gate_proj.weight"), take(f"{e}{j}.up_proj.weight")])
                         for j in experts])
        down = stack([take(f"{e}{j}.down_proj.weight") for j in experts])
        out[m + "experts.gate_up"], out[m + "experts.down"] = same_form(gate_up, down)
    if m + "shared_experts.gate_proj.weight" in src:
        out.update(mlp_tensors(m + "shared_experts.", take))
        out = {k.replace(m + "shared_experts.", m + "shared."): v for k, v in out.items()}
    return out
