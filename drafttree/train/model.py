"""A fresh DFlash or DFlash2 drafter for a target, and saving it in the published checkpoint format."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from drafttree.config import ModelConfig
from drafttree.models.decoder import DecoderLM
from drafttree.models.dflash import DFlashConfig, DFlashDrafter
from drafttree.models.dflash2 import ARCHITECTURE as DFLASH2, DFlash2Config, DFlash2Drafter

ARCHS = ("dflash", "dflash2")
# DFlash2's shape, as published (docs/dflash2.md): dflash_config fields and their defaults
DFLASH2_SHAPE = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}


@dataclass
class DrafterSpec:
    num_layers: int = 3
    intermediate_size: int | None = None      # default: the target's
    block_size: int = 16
    mask_token_id: int | None = None          # default: chosen from the data by the trainer
    target_layer_ids: tuple[int, ...] = ()
    arch: str = "dflash"                      # or "dflash2": the convolutions and the selector too
    dflash2: dict[str, int] | None = None     # DFlash2's shape (DFLASH2_SHAPE's fields); default: those


def arch_of(config: dict[str, Any]) -> str:
    """"dflash2" for a config declaring DFlash2DraftModel, else "dflash"."""
    return "dflash2" if DFLASH2 in (config.get("architectures") or []) else "dflash"


def as_dflash2(config: dict[str, Any], shape: dict[str, int] | None = None) -> dict[str, Any]:
    """A DFlash config dict made DFlash2's: its architecture and `shape` (DFLASH2_SHAPE's fields,
    its defaults for those not given) in dflash_config."""
    unknown = sorted(set(shape or {}) - set(DFLASH2_SHAPE))
    if unknown:
        raise ValueError(f"not a DFlash2 shape field: {unknown[0]} (they are {', '.join(DFLASH2_SHAPE)})")
    return {**config, "architectures": [DFLASH2],
            "dflash_config": {**config["dflash_config"], **DFLASH2_SHAPE, **(shape or {})}}


def drafter_config_dict(target: ModelConfig, spec: DrafterSpec) -> dict[str, Any]:
    """config.json of a Qwen3-style drafter with the target's width, heads and rope."""
    if spec.mask_token_id is None or not spec.target_layer_ids:
        raise ValueError("mask_token_id and target_layer_ids must be set")
    d: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": target.hidden_size, "num_attention_heads": target.num_heads,
        "num_key_value_heads": target.num_kv_heads, "head_dim": target.head_dim,
        "intermediate_size": spec.intermediate_size or target.intermediate_size,
        "num_hidden_layers": spec.num_layers, "num_target_layers": target.num_layers,
        "rms_norm_eps": target.rms_norm_eps, "rope_theta": target.rope_theta,
        "max_position_embeddings": target.max_position_embeddings, "vocab_size": target.vocab_size,
        "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
        "block_size": spec.block_size,
        "dflash_config": {"mask_token_id": int(spec.mask_token_id),
                          "target_layer_ids": [int(i) for i in spec.target_layer_ids]},
    }
    if target.rope_scaling:
        d["rope_scaling"] = dict(target.rope_scaling)
    if spec.arch == "dflash2":
        return as_dflash2(d, spec.dflash2)
    if spec.arch != "dflash":
        raise ValueError(f"arch must be one of {ARCHS}, got {spec.arch!r}")
    return d


def config_from_dict(d: dict[str, Any]) -> DFlashConfig:
    dc = d["dflash_config"]
    model = ModelConfig.from_dict({**d, "architectures": ["Qwen3ForCausalLM"]})
    base = DFlashConfig(model, int(d.get("block_size", dc.get("block_size"))), int(dc["mask_token_id"]),
                        tuple(int(i) for i in dc["target_layer_ids"]), d.get("num_target_layers"))
    return DFlash2Config.from_dict(d, base) if arch_of(d) == "dflash2" else base


def new_drafter(cfg: DFlashConfig, target: DecoderLM, init_std: float = 0.02,
                init_from_target: bool = False) -> DFlashDrafter:
    """Random init (normal(0, init_std) linears, unit norms), in fp32 on the target's device,
    borrowing the target's embedding and LM head. DFlash2's convolutions start as the identity
    (its backbone then computes what a DFlash drafter of the same weights does), its selector at
    normal(0, init_std)."""
    kind = DFlash2Drafter if isinstance(cfg, DFlash2Config) else DFlashDrafter
    drafter = kind(cfg, target.embed_tokens, target.lm_head)
    for name, p in drafter.named_parameters():
        with torch.no_grad():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, init_std)
    for layer in drafter.layers if kind is DFlash2Drafter else ():
        layer.attention_conv.reset_identity()
        layer.mlp_conv.reset_identity()
    if init_from_target:
        copy_target_layers(drafter, target)
    return drafter.to(device=target.embed_tokens.weight.device, dtype=torch.float32)


@torch.no_grad()
def to_dflash2(old: DFlashDrafter, config: dict[str, Any], target: DecoderLM,
               shape: dict[str, int] | None = None, init_std: float = 0.02) -> tuple[DFlash2Drafter, dict[str, Any]]:
    """A DFlash2 drafter from a DFlash one (config dict `config`): the same backbone weights, the
    convolutions at the identity and a fresh selector, so its unary logits are the old drafter's
    until trained. Returns the drafter (fp32, on the target's device) and its config."""
    config2 = as_dflash2(config, shape)
    new = new_drafter(config_from_dict(config2), target, init_std)
    missing, unexpected = new.load_state_dict(old.state_dict(), strict=False)
    assert not unexpected and all("_conv." in k or k.startswith("candidate_selector.") for k in missing), \
        (missing, unexpected)
    return new, config2


@torch.no_grad()
def copy_attention(dst: torch.nn.Module, src: torch.nn.Module) -> None:
    """A layer's norms and attention weights, from a layer of the same width and heads."""
    for a in ("input_layernorm", "post_attention_layernorm"):
        getattr(dst, a).weight.copy_(getattr(src, a).weight)
    dst.self_attn.qkv_proj.weight.copy_(src.self_attn.qkv_proj.weight)
    dst.self_attn.o_proj.weight.copy_(src.self_attn.o_proj.weight)
    if src.self_attn.q_norm is not None:
        dst.self_attn.q_norm.weight.copy_(src.self_attn.q_norm.weight)
        dst.self_attn.k_norm.weight.copy_(src.self_attn.k_norm.weight)


@torch.no_grad()
def copy_target_layers(drafter: DFlashDrafter, target: DecoderLM) -> None:
    """Start draft layer i from target layer L-n+i (the last n) and the final norm from the
    target's. MLPs narrower than the target's take the first rows/columns."""
    n, L = len(drafter.layers), len(target.layers)
    drafter.norm.weight.copy_(target.norm.weight)
    for i, dst in enumerate(drafter.layers):
        src = target.layers[max(L - n + i, 0)]
        copy_attention(dst, src)
        inter = dst.mlp.down_proj.weight.shape[1]
        t_inter = src.mlp.down_proj.weight.shape[1]
        if inter <= t_inter:
            gate, up = src.mlp.gate_up_proj.weight.chunk(2, dim=0)
            dst.mlp.gate_up_proj.weight.copy_(torch.cat([gate[:inter], up[:inter]]))
            dst.mlp.down_proj.weight.copy_(src.mlp.down_proj.weight[:, :inter])


@torch.no_grad()
def grow_drafter(old: DFlashDrafter, config: dict[str, Any], target: DecoderLM, layers: int | None = None,
                 intermediate: int | None = None, init_std: float = 0.02) -> tuple[DFlashDrafter, dict[str, Any]]:
    """A deeper and/or wider drafter that computes exactly what `old` does: new layers come after
    the old ones and new MLP units join every layer, each with its output projection at zero (a new
    layer's o_proj and down_proj, a new unit's down_proj column), so the residual stream is
    unchanged. Training then starts from the old drafter's acceptance, and the new capacity
    comes in as the gradients move those projections off zero. Returns the drafter (fp32, on the
    target's device) and its config."""
    n0, m0 = len(old.layers), old.layers[0].mlp.down_proj.weight.shape[1]
    n, m = layers or n0, intermediate or m0
    if n < n0 or m < m0:
        raise ValueError(f"a drafter only grows: it has {n0} layers of MLP width {m0}, asked for {n} and {m}")
    grown = {**config, "num_hidden_layers": n, "intermediate_size": m}
    new = new_drafter(config_from_dict(grown), target, init_std)
    old = old.to(device=new.fc.weight.device, dtype=torch.float32)
    for name in ("fc", "hidden_norm", "norm"):
        getattr(new, name).weight.copy_(getattr(old, name).weight)
    if isinstance(new, DFlash2Drafter):   # the selector as it was; a new layer's convolutions stay the identity
        new.candidate_selector.load_state_dict(old.candidate_selector.state_dict())
        for dst, src in zip(new.layers, old.layers):
            dst.attention_conv.load_state_dict(src.attention_conv.state_dict())
            dst.mlp_conv.load_state_dict(src.mlp_conv.state_dict())
    for i, dst in enumerate(new.layers):
        if i >= n0:
            dst.self_attn.o_proj.weight.zero_()
            dst.mlp.down_proj.weight.zero_()
            continue
        src = old.layers[i]
        copy_attention(dst, src)
        gate, up = dst.mlp.gate_up_proj.weight.chunk(2, dim=0)      # views: copies land in the weight
        src_gate, src_up = src.mlp.gate_up_proj.weight.chunk(2, dim=0)
        gate[:m0].copy_(src_gate)
        up[:m0].copy_(src_up)
        dst.mlp.down_proj.weight[:, :m0].copy_(src.mlp.down_proj.weight)
        dst.mlp.down_proj.weight[:, m0:].zero_()
    return new, grown


def published_state_dict(drafter: DFlashDrafter) -> dict[str, torch.Tensor]:
    """Our fused names -> the published ones: qkv_proj -> q/k/v_proj, gate_up -> gate/up."""
    out: dict[str, torch.Tensor] = {}
    for name, t in drafter.state_dict().items():
        t = t.detach()
        if name.endswith("self_attn.qkv_proj.weight"):
            attn = drafter.layers[int(name.split(".")[1])].self_attn
            sizes = [attn.h * attn.hd, attn.hkv * attn.hd, attn.hkv * attn.hd]
            p = name.removesuffix("qkv_proj.weight")
            for n, part in zip("qkv", t.split(sizes, dim=0)):
                out[f"{p}{n}_proj.weight"] = part
        elif name.endswith("mlp.gate_up_proj.weight"):
            p = name.removesuffix("gate_up_proj.weight")
            gate, up = t.chunk(2, dim=0)
            out[p + "gate_proj.weight"], out[p + "up_proj.weight"] = gate, up
        else:
            out[name] = t
    return out


def save_drafter(drafter: DFlashDrafter, config: dict[str, Any], out_dir: Path,
                 dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write config.json + model.safetensors in the published DFlash format."""
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.to(device="cpu", dtype=dtype).contiguous() for k, v in published_state_dict(drafter).items()}
    (out_dir / "config.json").write_text(json.dumps({**config, "torch_dtype": str(dtype).removeprefix("torch.")},
                                                    indent=2) + "\n")
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def count_parameters(config: dict[str, Any]) -> int:
    """Saved parameters of a drafter config (no embedding, no LM head)."""
    D, H, Hkv, hd = (config[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"))
    inter, n = config["intermediate_size"], len(config["dflash_config"]["target_layer_ids"])
    layer = D * (H + 2 * Hkv) * hd + H * hd * D + 3 * D * inter + 2 * D + 2 * hd
    if arch_of(config) == "dflash2":   # two convolutions per layer, the selector once
        dc = config["dflash_config"]
        k, groups, r = dc["conv_kernel_size"], D // dc["conv_group_size"], dc["selector_rank"]
        layer += 2 * (2 * k * D + 2 * k * groups * D)
        n_extra = 2 * config["vocab_size"] * r + r * D
    else:
        n_extra = 0
    return n * D * D + 2 * D + config["num_hidden_layers"] * layer + n_extra


def published_config(path: str | Path) -> dict[str, Any]:
    """A published drafter's config, to continue training it. Its measured defaults
    (ddtree_default_*: budget, schedule, sampled rounds) are dropped: they were for the old weights."""
    d = json.loads((Path(path) / "config.json").read_text())
    return {k: v for k, v in d.items() if not k.startswith("ddtree_default_")}
