"""Random tiny Hugging Face checkpoints (targets and DFlash drafters) written for the tests."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

SHAPES: dict[str, dict] = {
    # GQA, head_dim != hidden/heads, untied
    "llama": dict(arch="llama", hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  tie_word_embeddings=False),
    # llama3 rope scaling, tied, MHA
    "llama3": dict(arch="llama", hidden_size=32, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                   tie_word_embeddings=True,
                   rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
                                    "rope_theta": 500000.0}),
    # QKV bias, GQA 3:1, tied
    "qwen2": dict(arch="qwen2", hidden_size=36, num_attention_heads=6, num_key_value_heads=2, head_dim=6,
                  tie_word_embeddings=True),
    # q/k norm, explicit head_dim larger than hidden/heads, untied
    "qwen3": dict(arch="qwen3", hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  tie_word_embeddings=False),
    # one KV head (MQA): tensor-parallel ranks each hold a copy of it
    "llama-mqa": dict(arch="llama", hidden_size=32, num_attention_heads=4, num_key_value_heads=1, head_dim=8,
                      tie_word_embeddings=True),
    # three KV heads of nine query heads (SmolLM2's grouping): two ranks split them 2 + 1 by whole groups
    "llama-gqa3": dict(arch="llama", hidden_size=36, num_attention_heads=9, num_key_value_heads=3, head_dim=8,
                       tie_word_embeddings=True),
}


def make_target(path: Path, shape: str = "llama", vocab: int = 97, layers: int = 3, seed: int = 0,
                scale: float = 1.0) -> Path:
    """Save a random transformers model of the given shape; `scale` sharpens its logits."""
    import transformers as tf

    spec = dict(SHAPES[shape])
    arch = spec.pop("arch")
    cls_cfg, cls_model = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
                          "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
                          "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM)}[arch]
    cfg = cls_cfg(vocab_size=vocab, intermediate_size=64, num_hidden_layers=layers,
                  max_position_embeddings=512, eos_token_id=None, bos_token_id=None, **spec)
    torch.manual_seed(seed)
    model = cls_model(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 1:
                p.normal_(0.0, 0.1 * scale if p.dim() == 2 else 0.02)
        for n, p in model.named_parameters():
            if "norm" in n:
                p.fill_(1.0)
    model.save_pretrained(path)
    return path


def make_drafter(path: Path, target_dir: Path, block_size: int = 4, layers: int = 2, seed: int = 1,
                 target_layer_ids: list[int] | None = None, hidden: int | None = None,
                 vocab: int | None = None, head_dim: int = 8) -> Path:
    """Write a random drafter in the published DFlash format for `target_dir`."""
    t = json.loads((target_dir / "config.json").read_text())
    D = hidden or t["hidden_size"]
    H, Hkv, hd = 4, 2, head_dim
    ids = target_layer_ids or [0, t["num_hidden_layers"] - 1]
    V = vocab or t["vocab_size"]
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": D,
           "num_attention_heads": H, "num_key_value_heads": Hkv, "head_dim": hd, "intermediate_size": 64,
           "num_hidden_layers": layers, "num_target_layers": t["num_hidden_layers"], "rms_norm_eps": 1e-6,
           "rope_theta": 10000.0, "vocab_size": V, "max_position_embeddings": 512, "block_size": block_size,
           "dflash_config": {"mask_token_id": V - 1, "target_layer_ids": ids}}
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.2  # noqa: E731
    w = {"fc.weight": r(D, len(ids) * D), "hidden_norm.weight": torch.ones(D), "norm.weight": torch.ones(D)}
    for i in range(layers):
        p = f"layers.{i}."
        w.update({p + "input_layernorm.weight": torch.ones(D), p + "post_attention_layernorm.weight": torch.ones(D),
                  p + "self_attn.q_proj.weight": r(H * hd, D), p + "self_attn.k_proj.weight": r(Hkv * hd, D),
                  p + "self_attn.v_proj.weight": r(Hkv * hd, D), p + "self_attn.o_proj.weight": r(D, H * hd),
                  p + "self_attn.q_norm.weight": torch.ones(hd), p + "self_attn.k_norm.weight": torch.ones(hd),
                  p + "mlp.gate_proj.weight": r(64, D), p + "mlp.up_proj.weight": r(64, D),
                  p + "mlp.down_proj.weight": r(D, 64)})
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file({k: v.contiguous() for k, v in w.items()}, str(path / "model.safetensors"))
    return path


def edit_config(path: Path, **updates) -> Path:
    """Merge `updates` into a checkpoint's config.json (dict values merge one level deep)."""
    f = Path(path) / "config.json"
    cfg = json.loads(f.read_text())
    for k, v in updates.items():
        if isinstance(v, dict) and isinstance(cfg.get(k), dict):
            cfg[k] = {**cfg[k], **v}
        else:
            cfg[k] = v
    f.write_text(json.dumps(cfg, indent=1))
    return path


def edit_tensors(path: Path, fn) -> Path:
    """Rewrite a single-file checkpoint's tensors with fn(dict name -> tensor) -> dict."""
    from safetensors.torch import load_file

    f = Path(path) / "model.safetensors"
    save_file({k: v.contiguous() for k, v in fn(load_file(str(f))).items()}, str(f), metadata={"format": "pt"})
    return path


def copy_checkpoint(src: Path, dst: Path) -> Path:
    """Copy a checkpoint directory (config, weights, anything else) to `dst`."""
    import shutil

    shutil.copytree(src, dst)
    return dst


def write_tokenizer(path: Path, vocab: int) -> Path:
    """A character-level tokenizer of `vocab` ids beside a tiny checkpoint, so that text prompts
    (the CLI's) reach it: id 0 unknown, then printable ASCII, then fillers. No EOS token and no
    chat template, so a prompt is its characters and only max_tokens ends a generation."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>"] + [chr(c) for c in range(32, 127)]
    pieces = (pieces + [f"<extra_{i}>" for i in range(max(vocab - len(pieces), 0))])[:vocab]
    tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(str(path))
    return path
