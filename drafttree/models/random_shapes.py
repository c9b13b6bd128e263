"""Model shapes for timing-only runs with random weights (no checkpoint needs to exist).

They sit beside the models so that the engine can build them (`EngineConfig.random_weights`)
without importing the benchmark or training packages. A shape is 'name', 'name@N' (its first N
layers) and, for the MoE shapes, ':int4' or ':fp8' after either ('kimi-k2:int4', 'kimi-k2@3:int4')
for routed experts kept as a quantized checkpoint stores them (`models.quant_experts`): int4 in
groups of 32 as Kimi K2.6's, or e4m3 in 128 x 128 blocks as DeepSeek-V3's; drawn as such, never
as 16-bit weights first, so that a rank's shards of Kimi K2 at full depth build within its memory."""
from __future__ import annotations

import dataclasses
import zlib

import torch
from torch import nn

from drafttree.config import ModelConfig
from drafttree.models.decoder import DecoderLM
from drafttree.models.dflash import DFlashConfig, DFlashDrafter, default_target_layer_ids
from drafttree.models.layers import Rotary
from drafttree.models.moe import SparseMoE
from drafttree.models.moe_decoder import build_rotary, build_target, fp32_parameters
from drafttree.models.quant_experts import Fp8BlockExperts, Int4Experts, StoredExperts
from drafttree.parallel.group import TPGroup
from drafttree.parallel.shard import kv_heads_per_rank, q_span

# The published config.json fields of the MoE/MLA shapes (token ids left out), parsed as a checkpoint's.
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
                 "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32,
                 "num_key_value_heads": 4, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
                 "max_position_embeddings": 40960, "num_experts": 128, "num_experts_per_tok": 8,
                 "moe_intermediate_size": 768, "norm_topk_prob": True, "decoder_sparse_step": 1,
                 "mlp_only_layers": [], "tie_word_embeddings": False}
KIMI_K2 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "vocab_size": 163840,
           "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
           "num_attention_heads": 64, "num_key_value_heads": 64, "n_shared_experts": 1, "n_routed_experts": 384,
           "routed_scaling_factor": 2.827, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
           "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1,
           "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
           "scoring_func": "sigmoid", "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 50000.0,
           "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                            "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
           "tie_word_embeddings": False}
# Kimi K2's layout at a size the CPU runs in moments (the tests' and a CPU run of the rank benchmark):
# MLA with q-LoRA, sigmoid top-2 of 8 experts of 32 rows (int4 groups of 32 fit), a shared expert,
# the first layer dense
TINY_MLA = {**KIMI_K2, "vocab_size": 384, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 8,
            "num_experts_per_tok": 2, "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 16,
            "v_head_dim": 16, "qk_nope_head_dim": 16, "max_position_embeddings": 4096, "rope_scaling": None}

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
    # 128 experts, 8 active, renormalised, every layer sparse
    "qwen3-30b-a3b": (ModelConfig.from_dict(QWEN3_30B_A3B),
                      dict(layers=5, block_size=16, mask_token_id=151669, target_layer_ids=(1, 12, 23, 34, 45))),
    # MLA, 384 experts, 8 active, 1 shared, the first layer dense, yarn x32
    "kimi-k2": (ModelConfig.from_dict(KIMI_K2),
                dict(layers=5, block_size=16, mask_token_id=163839, target_layer_ids=(1, 15, 30, 45, 58))),
    "tiny-mla": (ModelConfig.from_dict(TINY_MLA), dict(layers=1, block_size=4, mask_token_id=383,
                                                       target_layer_ids=(0, 2))),
}


# routed experts as stored: (the experts' class, its layout)
EXPERT_FORMS: dict[str, tuple[type[StoredExperts], dict]] = {
    "int4": (Int4Experts, dict(group_size=32, scale_dtype=torch.bfloat16)),   # Kimi K2.6's
    "fp8": (Fp8BlockExperts, dict(block=(128, 128), scale_dtype=torch.float32)),   # DeepSeek-V3's
}


def parse_shape(shape: str) -> tuple[str, str, str | None]:
    """(name, layers ('' for all), experts' stored form or None) of 'name[:form][@N]' or 'name@N:form'."""
    head, _, layers = shape.partition("@")
    name, _, form = head.partition(":")
    if ":" in layers:
        layers, _, form = layers.partition(":")
    if form and form not in EXPERT_FORMS:
        raise ValueError(f"{shape}: unknown experts' form {form!r}; choose one of {sorted(EXPERT_FORMS)}")
    return name, layers, form or None


def shape_config(shape: str) -> tuple[ModelConfig, dict]:
    """A shape's (target config, drafter dict); 'name@N' keeps only the first N layers (a big model's
    per-layer timing on one GPU), the drafter then reading default target layers."""
    name, layers, form = parse_shape(shape)
    if name not in SHAPES:
        raise ValueError(f"unknown random shape {name!r}; choose one of {sorted(SHAPES)} (name@layers to cut, "
                         f"name:{'|'.join(EXPERT_FORMS)} for stored experts)")
    cfg, d = SHAPES[name]
    if form and cfg.moe is None:
        raise ValueError(f"{shape}: {name} has no routed experts to store as {form}")
    if not layers:
        return cfg, d
    n = int(layers)
    if not 1 <= n:
        raise ValueError(f"{shape}: the layer count must be at least 1")
    moe = cfg.moe and dataclasses.replace(cfg.moe, sparse_layers=tuple(i for i in cfg.moe.sparse_layers if i < n))
    cfg = dataclasses.replace(cfg, num_layers=n, moe=moe)
    return cfg, dict(d, target_layer_ids=tuple(default_target_layer_ids(n, min(5, n))))


def projections(cfg: ModelConfig, world: int = 1, rank: int = 0) -> dict[str, tuple[int, int]]:
    """(N, K) of one layer's four projection weights, as the layers fuse them, on rank `rank` of a
    tensor-parallel group of `world` ranks (`parallel.shard`)."""
    D, I, HD = cfg.hidden_size, cfg.intermediate_size // world, q_span(cfg, world, rank)[1] * cfg.head_dim
    KV = kv_heads_per_rank(cfg.num_kv_heads, world, rank) * cfg.head_dim
    return {"qkv": (HD + 2 * KV, D), "o": (D, HD), "gate_up": (2 * I, D), "down": (D, I)}


def _randomize(m: nn.Module, device: torch.device, dtype: torch.dtype, seed: int, by_name: bool = False) -> None:
    """Norms 1, matrices N(0, 0.02) drawn in the parameters' order from one seed; or `by_name`,
    each from a seed of its name, so that the tensors a tensor-parallel rank holds whole (a router,
    MLA's latent projections, a KV head that ranks share) are the same on every rank. Drawn in
    `dtype` (the meta module takes it before any memory is allocated): a model that fits in bf16
    must not be made in fp32 first. Buffers (stored experts' included) are left to their owners."""
    for p in m.parameters():
        p.data = p.data.to(dtype)
    m.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                if by_name:
                    g.manual_seed(seed + zlib.crc32(name.encode()))
                p.normal_(0.0, 0.02, generator=g)


def random_target(shape: str, device: torch.device, dtype: torch.dtype, tp: TPGroup | None = None) -> DecoderLM:
    return random_model(shape_config(shape)[0], device, dtype, tp, parse_shape(shape)[2])


def random_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, tp: TPGroup | None = None,
                 experts: str | None = None) -> DecoderLM:
    """A target of any shape with random weights (over `tp`, this rank's shards only, as random);
    `experts` 'int4' or 'fp8': the routed experts stored so (`EXPERT_FORMS`)."""
    with torch.device("meta"):
        model = build_target(cfg, tp)
        if experts is not None:
            cls, layout = EXPERT_FORMS[experts]
            for layer in model.layers:
                if isinstance(layer.mlp, SparseMoE):
                    layer.mlp.experts = cls(cfg.hidden_size, cfg.moe, tp, **layout)
    _randomize(model, device, dtype, 0, by_name=tp is not None)
    g = torch.Generator(device=device).manual_seed(2)
    for m in model.modules():
        if isinstance(m, StoredExperts):
            _fill_stored(m, g)
    for name in fp32_parameters(model):
        model.get_parameter(name).data = model.get_parameter(name).data.float()
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = build_rotary(cfg).to(device)
    return model.eval().requires_grad_(False)


INT4_STD = 4.6   # of a nibble uniform over [-8, 7]


@torch.no_grad()
def _fill_stored(ex: StoredExperts, g: torch.Generator) -> None:
    """Weights of about N(0, 0.02): int4 words of uniform nibbles at scale 0.02 / INT4_STD, or e4m3
    values of N(0, 1) at scale 0.02 (drawn one expert at a time, in bf16)."""
    for t in (ex.gate_up, ex.down):
        if isinstance(ex, Int4Experts):
            t.random_(-2**31, 2**31, generator=g)
        else:
            for e in range(t.shape[0]):
                t[e].copy_(torch.randn(t.shape[1:], generator=g, device=t.device, dtype=torch.bfloat16))
    scale = 0.02 / INT4_STD if isinstance(ex, Int4Experts) else 0.02
    ex.gate_up_scale.fill_(scale)
    ex.down_scale.fill_(scale)


def random_drafter(shape: str, target: DecoderLM, device: torch.device, dtype: torch.dtype) -> DFlashDrafter:
    return drafter_from_config(random_drafter_config(shape, target.cfg), target, device, dtype)


def random_drafter_config(shape: str, tcfg: ModelConfig) -> DFlashConfig:
    """The drafter config a random-weight shape comes with (no weights)."""
    d = shape_config(shape)[1]
    return drafter_config_for(tcfg, d["block_size"], d["layers"], d["target_layer_ids"], d["mask_token_id"])


def drafter_config_for(tcfg: ModelConfig, block_size: int = 16, layers: int = 3,
                       layer_ids: tuple[int, ...] | None = None, mask_token_id: int | None = None) -> DFlashConfig:
    """The config of an untrained drafter shaped for a target of config `tcfg` (timing only)."""
    # a dense Qwen3-style drafter; an MLA target's cache-shaped heads become GQA heads of 128
    dense = {"moe": None, "mla": None, "rope_scaling": None} if tcfg.moe or tcfg.mla else {}
    if tcfg.mla:
        dense.update(num_kv_heads=max(1, tcfg.num_heads // 8), head_dim=128)
    mcfg = ModelConfig(**{**tcfg.__dict__, "num_layers": layers, "arch": "qwen3", "qk_norm": True,
                          "tie_word_embeddings": False, **dense})
    ids = tuple(layer_ids or default_target_layer_ids(tcfg.num_layers, min(5, tcfg.num_layers)))
    cfg = DFlashConfig(mcfg, block_size, tcfg.vocab_size - 1 if mask_token_id is None else mask_token_id,
                       ids, tcfg.num_layers)
    cfg.check_fits(tcfg)
    return cfg


def drafter_from_config(cfg: DFlashConfig, target: DecoderLM, device: torch.device,
                        dtype: torch.dtype) -> DFlashDrafter:
    """An untrained drafter of `cfg` for `target`, random weights (timing only)."""
    with torch.device("meta"):
        drafter = DFlashDrafter(cfg)
    _randomize(drafter, device, dtype, 1)
    drafter.rotary = Rotary(cfg.model).to(device)
    return drafter.borrow(target.embed_tokens, target.lm_head).eval().requires_grad_(False)


def drafter_for(target: DecoderLM, device: torch.device, dtype: torch.dtype, block_size: int = 16,
                layers: int = 3, layer_ids: tuple[int, ...] | None = None,
                mask_token_id: int | None = None) -> DFlashDrafter:
    """An untrained drafter shaped for `target` (timing only)."""
    return drafter_from_config(drafter_config_for(target.cfg, block_size, layers, layer_ids, mask_token_id),
                               target, device, dtype)
