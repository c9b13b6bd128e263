"""Load Hugging Face safetensors checkpoints (single file or sharded index) into our modules."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from torch import nn

from drafttree.config import ModelConfig
from drafttree.loader import quantization
from drafttree.loader.lazy_tensors import CheckpointTensors
from drafttree.loader.moe_weights import attention_tensors, layer_tensors, mlp_tensors
from drafttree.loader.packed import Weight, dense
from drafttree.loader.quantization import Quantization
from drafttree.loader.stored import install
from drafttree.models.moe_decoder import SparseDecoderLM, build_rotary, fp32_parameters
from drafttree.models.quant_linear import stored_dtypes
from drafttree.parallel import shard
from drafttree.parallel.group import TPGroup

StateDict = dict[str, torch.Tensor]


def read_safetensors(path: str | Path, select: shard.Select | None = None) -> StateDict:
    """Every tensor of a checkpoint; with `select` (a tensor-parallel rank's, `parallel.shard`),
    the slice it names of each tensor, read as such (the rest of the tensor is never read)."""
    path = Path(path)
    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index} is not a valid safetensors index: {e}") from None
        files = [path / f for f in sorted(set(weight_map.values()))]
    else:
        raise FileNotFoundError(f"{path} has no model.safetensors or model.safetensors.index.json")
    out: StateDict = {}
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"checkpoint shard {f} is missing")
        try:
            with safe_open(str(f), framework="pt") as fh:
                for k in fh.keys():
                    part = None if select is None else select(k, fh.get_slice(k).get_shape())
                    out[k] = fh.get_tensor(k) if part is None else fh.get_slice(k)[part]
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise ValueError(f"cannot read {f}: {e}") from None
    return out


def target_state_dict(hf: StateDict, num_layers: int, tied: bool) -> StateDict:
    """Map HF names to ours, fusing q/k/v into qkv_proj and gate/up into gate_up_proj."""
    src = {k.removeprefix("model."): v for k, v in hf.items()}
    out: StateDict = {}

    def take(name: str) -> torch.Tensor:
        if name not in src:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        return src[name]

    out["embed_tokens.weight"] = take("embed_tokens.weight")
    out["norm.weight"] = take("norm.weight")
    if not tied:
        out["lm_head.weight"] = hf.get("lm_head.weight", src.get("lm_head.weight"))
        if out["lm_head.weight"] is None:
            raise ValueError("checkpoint is missing tensor 'lm_head.weight' (tie_word_embeddings is false)")
    for i in range(num_layers):
        out.update(layer_state_dict(src, f"layers.{i}.", take))
    return out


def layer_state_dict(src: StateDict, p: str, take: Callable[[str], torch.Tensor]) -> StateDict:
    out = {p + n + ".weight": take(p + n + ".weight") for n in ("input_layernorm", "post_attention_layernorm")}
    out.update(attention_tensors(src, p + "self_attn.", take))
    out.update(mlp_tensors(p + "mlp.", take))
    return out


def check_state(module: nn.Module, state: StateDict) -> dict[str, torch.Tensor]:
    """The module's parameters and buffers, once `state` is known to hold each of them at its shape
    (and the buffers kept as stored at their dtype)."""
    expected: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=True))
    expected.update(persistent_buffers(module))
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"checkpoint is missing tensors: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    kept = stored_dtypes(module)
    for name, param in expected.items():
        t = state[name]
        if tuple(t.shape) != tuple(param.shape):
            raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, the config implies {tuple(param.shape)}")
        if name in kept and t.dtype != kept[name]:
            raise ValueError(f"tensor {name!r} is {t.dtype}, where {kept[name]} was announced")
    return expected


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a state dict holds (the stored weights of `models.quant_linear`'s modules)."""
    return {f"{path}.{n}" if path else n: b for path, m in module.named_modules()
            for n, b in m.named_buffers(recurse=False) if n not in m._non_persistent_buffers_set}


def load_into(module: nn.Module, state: StateDict, dtype: torch.dtype, device: str | torch.device) -> None:
    """Copy `state` into a module built on the meta device; shapes must match exactly. Weights kept
    as stored (int4 words, e4m3, their scales) keep their dtypes; the rest takes `dtype`."""
    expected = check_state(module, state)
    kept = stored_dtypes(module)
    fixed = {n: state[n].to(device=device, dtype=kept.get(n, dtype)) for n in expected}
    module.load_state_dict(fixed, strict=False, assign=True)   # non-persistent buffers: the caller rebuilds them


def load_target(path: str | Path, dtype: torch.dtype, device: str | torch.device, tp: TPGroup | None = None):
    """Build a DecoderLM (a SparseDecoderLM for MoE/MLA models) from a Hugging Face directory;
    raises before allocating on bad input. Over a tensor-parallel group, this rank's shards only
    (`parallel.shard`)."""
    from drafttree.models.decoder import DecoderLM
    from drafttree.models.layers import Rotary

    cfg = ModelConfig.from_dir(path)
    quant = quantization.from_dir(path)   # before any weight: an unsupported form is refused here
    if tp is not None:
        shard.check_size(cfg, tp.world)
    if cfg.sparse:
        return load_sparse_target(Path(path), cfg, dtype, device, tp, quant), cfg
    if quant is not None:
        raise ValueError(f"quantized checkpoints ({quant.describe()}) load for the MoE and MLA targets "
                         f"(Qwen3-MoE, DeepSeek-V3 / Kimi K2); this one is a dense {cfg.arch} model")
    select = None if tp is None else shard.selector(cfg, tp.rank, tp.world)
    state = target_state_dict(read_safetensors(path, select), cfg.num_layers, cfg.tie_word_embeddings)
    if tp is not None:
        for name in ("embed_tokens.weight", "lm_head.weight"):
            if name in state:
                state[name] = shard.pad_vocab(state[name], cfg.vocab_size, tp.world)
    with torch.device("meta"):
        model = DecoderLM(cfg, tp)
    load_into(model, state, dtype, device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = Rotary(cfg).to(device)
    return model.eval().requires_grad_(False), cfg


def load_sparse_target(path: Path, cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device,
                       tp: TPGroup | None = None, quant: Quantization | None = None) -> SparseDecoderLM:
    """A Qwen3-MoE or DeepSeek-V3 checkpoint, read and placed one layer at a time (its experts
    stacked then), so that host memory holds about one layer beyond what is read. Weights stored
    quantized (`quant`: int4 packed, fp8 blocks) stay so on the device, in the modules that take
    them (`loader.stored`); routers keep fp32. Every name and shape is checked first, with nothing
    read. Over `tp`, this rank's slices and experts only."""
    world, rank = (tp.world, tp.rank) if tp is not None else (1, 0)
    src = CheckpointTensors(path, None if tp is None else shard.selector(cfg, rank, world), quant, world)
    experts = None
    if cfg.moe is not None:
        first, n = shard.expert_span(cfg.moe.num_experts, world, rank)
        experts = range(first, first + n)
    with torch.device("meta"):
        model = SparseDecoderLM(cfg, tp)
    top = [(model.embed_tokens, "embed_tokens.weight"), (model.norm, "norm.weight")]
    if not cfg.tie_word_embeddings:
        top.append((model.lm_head, "lm_head.weight"))
    for view in (src.shapes(), src):   # meta tensors first: the checks; then the weights
        take = _taker(view)
        if tp is not None:
            take = _vocab_padded(take, cfg.vocab_size, world)
        for i, layer in enumerate(model.layers):
            state = install(layer, layer_tensors(view, cfg, i, take, experts))
            if view is not src:
                check_state(layer, state)
                continue
            load_into(layer, state, dtype, device)
            for name in fp32_parameters(layer, "mlp.router."):
                layer.get_parameter(name).data = state[name].to(device=device, dtype=torch.float32)
        for module, name in top:
            if view is src:
                load_into(module, {"weight": dense(take(name))}, dtype, device)
            else:
                check_state(module, {"weight": dense(take(name))})
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = build_rotary(cfg).to(device)
    return model.eval().requires_grad_(False)


def _vocab_padded(take: Callable[[str], Weight], vocab: int, world: int) -> Callable[[str], Weight]:
    """`take`, the vocabulary shards (embedding, LM head) padded to ceil(V / N) rows."""
    def padded(name: str) -> Weight:
        if name in ("embed_tokens.weight", "lm_head.weight"):
            return shard.pad_vocab(dense(take(name)), vocab, world)
        return take(name)
    return padded


def _taker(src) -> Callable[[str], Weight]:
    def take(name: str) -> Weight:
        if name not in src:
            raise ValueError(f"checkpoint is missing tensor {name!r}"
                             + (" (tie_word_embeddings is false)" if name == "lm_head.weight" else ""))
        return src[name]
    return take
