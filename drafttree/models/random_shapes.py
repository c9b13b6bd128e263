"""Model shapes for timing-only runs with random weights (no checkpoint needs to exist).

They sit beside the models so that the engine can build them (`EngineConfig.random_weights`)
without importing the benchmark or training packages."""
from __future__ import annotations

import torch
from torch import nn

from drafttree.config import ModelConfig
from drafttree.models.decoder import DecoderLM
from drafttree.models.dflash import DFlashConfig, DFlashDrafter, default_target_layer_ids
from drafttree.models.layers import Rotary
from drafttree.parallel.group import TPGroup
from drafttree.parallel.shard import kv_heads_per_rank

SHAPES: dict[str, tuple[ModelConfig, dict]] = {
    "qwen3-8b": (ModelConfig(arch="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                             num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
                             rope_theta=1e6, max_position_embeddings=40960, qk_norm=True),
                 dict(layers=5, block_size=16, mask_token_id=151669, target_layer_ids=(1, 9, 17, 25, 33))),
    "qwen3-32b": (ModelConfig(arch="qwen3", vocab_size=151936, hidden_size=5120, intermediate_size=25600,
                              num_layers=64, num_heads=64, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
                              rope_theta=1e6, max_position_embeddings=40960, qk_norm=True),
                  dict(layers=5, block_size=16, mask_token_id=151669, target_layer_ids=(1, 16, 31, 46, 61))),
    "smollm2-135m": (ModelConfig(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                 num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                                 rope_theta=1e5, max_position_embeddings=8192, tie_word_embeddings=True),
                     dict(layers=3, block_size=16, mask_token_id=49151, target_layer_ids=(1, 7, 14, 21, 27))),
}


def shape_config(shape: str) -> ModelConfig:
    if shape not in SHAPES:
        raise ValueError(f"unknown random shape {shape!r}; choose one of {sorted(SHAPES)}")
    return SHAPES[shape][0]


def projections(cfg: ModelConfig, world: int = 1) -> dict[str, tuple[int, int]]:
    """(N, K) of one layer's four projection weights, as the layers fuse them, on one rank of a
    tensor-parallel group of `world` ranks (`parallel.shard`)."""
    D, I, HD = cfg.hidden_size, cfg.intermediate_size // world, cfg.num_heads // world * cfg.head_dim
    KV = kv_heads_per_rank(cfg.num_kv_heads, world) * cfg.head_dim
    return {"qkv": (HD + 2 * KV, D), "o": (D, HD), "gate_up": (2 * I, D), "down": (D, I)}


def _randomize(m: nn.Module, device: torch.device, dtype: torch.dtype, seed: int) -> None:
    m.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    m.to(dtype)


def random_target(shape: str, device: torch.device, dtype: torch.dtype, tp: TPGroup | None = None) -> DecoderLM:
    return random_model(shape_config(shape), device, dtype, tp)


def random_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, tp: TPGroup | None = None) -> DecoderLM:
    """A target of any shape with random weights (over `tp`, this rank's shards only, as random)."""
    with torch.device("meta"):
        model = DecoderLM(cfg, tp)
    _randomize(model, device, dtype, 0)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = Rotary(cfg).to(device)
    return model.eval().requires_grad_(False)


def random_drafter(shape: str, target: DecoderLM, device: torch.device, dtype: torch.dtype) -> DFlashDrafter:
    d = SHAPES[shape][1]
    return drafter_for(target, device, dtype, d["block_size"], d["layers"], d["target_layer_ids"],
                       d["mask_token_id"])


def drafter_for(target: DecoderLM, device: torch.device, dtype: torch.dtype, block_size: int = 16,
                layers: int = 3, layer_ids: tuple[int, ...] | None = None,
                mask_token_id: int | None = None) -> DFlashDrafter:
    """An untrained drafter shaped for `target` (timing only)."""
    tcfg = target.cfg
    mcfg = ModelConfig(**{**tcfg.__dict__, "num_layers": layers, "arch": "qwen3", "qk_norm": True,
                          "tie_word_embeddings": False})
    ids = tuple(layer_ids or default_target_layer_ids(tcfg.num_layers, min(5, tcfg.num_layers)))
    cfg = DFlashConfig(mcfg, block_size, tcfg.vocab_size - 1 if mask_token_id is None else mask_token_id,
                       ids, tcfg.num_layers)
    cfg.check_fits(tcfg)
    with torch.device("meta"):
        drafter = DFlashDrafter(cfg)
    _randomize(drafter, device, dtype, 1)
    drafter.rotary = Rotary(mcfg).to(device)
    return drafter.borrow(target.embed_tokens, target.lm_head).eval().requires_grad_(False)
