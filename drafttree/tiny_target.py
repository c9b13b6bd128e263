"""Tiny random Hugging Face targets, written with transformers so that they load as any checkpoint
does: the tests' targets, and the model of benchmarks that time the engine's host-side work
(admission, scheduling)."""
from __future__ import annotations

from pathlib import Path

import torch

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
