"""Model and engine configuration, parsed once from a checkpoint's config.json."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from drafttree.moe_config import MLAConfig, MoEConfig, parse_mla, parse_moe

SUPPORTED_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",   # Kimi K2 declares it too
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device asked for, or CUDA when there is one, else the CPU."""
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def parse_dtype(dtype: str | torch.dtype | None, device: str = "cpu") -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


@dataclass
class ModelConfig:
    arch: str                      # "llama" | "qwen2" | "qwen3" | "qwen3_moe" | "deepseek_v3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False   # Qwen2: bias on q/k/v
    qk_norm: bool = False          # Qwen3: RMSNorm over head_dim on q and k
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    # MoE layers and MLA (moe_config.py). With MLA, num_kv_heads is 1 and head_dim the latent cache
    # entry's width (kv_lora_rank + qk_rope_head_dim), which the K cache holds; V has no width.
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None

    @property
    def sparse(self) -> bool:
        """MoE layers or MLA: built as `models.moe_decoder.SparseDecoderLM`."""
        return self.moe is not None or self.mla is not None or self.arch in ("qwen3_moe", "deepseek_v3")

    @property
    def v_cache_dim(self) -> int:
        """The V cache's width: MLA keeps only the latent, in the K cache."""
        return 0 if self.mla is not None else self.head_dim

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        if isinstance(d.get("text_config"), dict) and "hidden_size" not in d:
            d = d["text_config"]   # a multimodal wrapper (Kimi K2.5 / K2.6): its language model
        archs = d.get("architectures") or []
        arch = next((SUPPORTED_ARCHS[a] for a in archs if a in SUPPORTED_ARCHS), None)
        if arch is None:
            arch = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe",
                    "deepseek_v3": "deepseek_v3", "kimi_k2": "deepseek_v3"}.get(d.get("model_type", ""))
        if arch is None:
            raise ValueError(f"unsupported architecture {archs or d.get('model_type')!r}; "
                             f"drafttree runs {sorted(SUPPORTED_ARCHS)}")
        try:
            heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            layers = int(d["num_hidden_layers"])
            rope_scaling = _rope_scaling(d, arch)
            mla = parse_mla(d, rope_scaling) if arch == "deepseek_v3" else None
            eos = d.get("eos_token_id")
            eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
            return cls(
                arch=arch,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=1 if mla else int(d.get("num_key_value_heads") or heads),
                head_dim=mla.cache_dim if mla else int(d.get("head_dim") or hidden // heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
                rope_scaling=rope_scaling,
                max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=bool(d.get("attention_bias", arch == "qwen2")),
                qk_norm=arch in ("qwen3", "qwen3_moe"),
                eos_token_ids=eos_ids,
                bos_token_id=d.get("bos_token_id"),
                moe=parse_moe(d, arch, layers) if arch in ("qwen3_moe", "deepseek_v3") else None,
                mla=mla,
            )
        except KeyError as e:
            raise ValueError(f"config.json is missing required field {e.args[0]!r}") from None

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        cfg = Path(path) / "config.json"
        if not cfg.is_file():
            raise FileNotFoundError(f"{cfg} not found: a model directory needs config.json")
        try:
            d = json.loads(cfg.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg} is not valid JSON: {e}") from None
        c = cls.from_dict(d)
        gen = Path(path) / "generation_config.json"
        if gen.is_file() and not c.eos_token_ids:
            eos = json.loads(gen.read_text()).get("eos_token_id")
            if eos is not None:
                c.eos_token_ids = [eos] if isinstance(eos, int) else list(eos)
        return c


SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(model_dir: Path | None) -> dict[str, float | int]:
    """The sampling a model recommends: its generation_config.json's fields of SAMPLING_DEFAULTS
    (vLLM's `--generation-config auto` takes the same), {} without the file."""
    gen = None if model_dir is None else Path(model_dir) / "generation_config.json"
    if gen is None or not gen.is_file():
        return {}
    try:
        d = json.loads(gen.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{gen} is not valid JSON: {e}") from None
    return {k: d[k] for k in SAMPLING_DEFAULTS if d.get(k) is not None}


# yarn only where the MoE/MLA models' own rotary (models/rope.py) reads it
YARN_ARCHS = ("qwen3_moe", "deepseek_v3")


def _rope_scaling(d: dict[str, Any], arch: str = "llama") -> dict[str, Any] | None:
    rs = d.get("rope_scaling") or d.get("rope_parameters")
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind in ("default", None):
        return None
    supported = ("llama3", "yarn") if arch in YARN_ARCHS else ("llama3",)
    if kind not in supported:
        raise ValueError(f"unsupported rope_scaling type {kind!r} for {arch} (supported: {', '.join(supported)})")
    return dict(rs, rope_type=kind)
