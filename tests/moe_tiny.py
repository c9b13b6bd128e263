"""Random tiny Qwen3-MoE and DeepSeek-V3 checkpoints (written by transformers' save_pretrained:
one tensor per expert), and DeepSeek's fp8 block-scaled format made from one of them."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from drafttree.models.kv_cache import KVCache, PagedKVCache, attn_meta, causal

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32,
        "beta_slow": 1}

SHAPES: dict[str, dict] = {
    # softmax top-2 of 8, renormalised; layer 1 dense (mlp_only_layers); GQA; untied
    "qwen3_moe": dict(arch="qwen3_moe", hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
                      mlp_only_layers=[1], tie_word_embeddings=False),
    # top-3 of 6 not renormalised, every second layer sparse, yarn rope, MHA, tied
    "qwen3_moe_yarn": dict(arch="qwen3_moe", hidden_size=24, num_attention_heads=3, num_key_value_heads=3,
                           head_dim=8, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=12,
                           norm_topk_prob=False, decoder_sparse_step=2, tie_word_embeddings=True,
                           rope_parameters={**YARN, "rope_theta": 1e6}),
    # q_lora, yarn with mscale != mscale_all_dim, 4 groups keep 2, one dense layer first, a shared
    # expert, interleaved rope, untied
    "deepseek_v3": dict(arch="deepseek_v3", hidden_size=32, num_attention_heads=4, q_lora_rank=24,
                        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8,
                        num_experts_per_tok=2, moe_intermediate_size=16, n_group=4, topk_group=2,
                        first_k_dense_replace=1, n_shared_experts=1, norm_topk_prob=True,
                        routed_scaling_factor=2.5, tie_word_embeddings=False,
                        rope_parameters={**YARN, "mscale": 0.707, "mscale_all_dim": 1.0, "rope_theta": 10000.0}),
    # no q_lora, ungrouped, two shared experts, weights not renormalised, rope not interleaved,
    # every layer sparse, tied
    "deepseek_v3_plain": dict(arch="deepseek_v3", hidden_size=24, num_attention_heads=2, q_lora_rank=None,
                              kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=8,
                              n_routed_experts=6, num_experts_per_tok=3, moe_intermediate_size=8, n_group=1,
                              topk_group=1, first_k_dense_replace=0, n_shared_experts=2, norm_topk_prob=False,
                              routed_scaling_factor=1.5, rope_interleave=False, tie_word_embeddings=True),
}


def make_moe_target(path: Path, shape: str, vocab: int = 97, layers: int = 3, seed: int = 0, scale: float = 1.0,
                    max_shard_size: str | None = None, **changes) -> Path:
    """Save a random transformers model of the shape (config fields in `changes` replaced); `scale`
    sharpens its logits. Routers and DeepSeek's correction biases are random too, so that routing
    differs by token."""
    import transformers as tf

    spec = {**SHAPES[shape], **changes}
    arch = spec.pop("arch")
    cls_cfg, cls_model = {"qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
                          "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM)}[arch]
    cfg = cls_cfg(vocab_size=vocab, intermediate_size=40, num_hidden_layers=layers, max_position_embeddings=512,
                  eos_token_id=None, bos_token_id=None, **spec)
    torch.manual_seed(seed)
    model = cls_model(cfg).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.normal_(0.0, 0.1 * scale if p.dim() >= 2 else 0.02)
            if "norm" in n:
                p.fill_(1.0)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.2)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return path


def fp8_copy(src: Path, fp8_dir: Path, dequant_dir: Path, block: tuple[int, int] = (8, 8)) -> tuple[Path, Path]:
    """From a single-file checkpoint: `fp8_dir`, DeepSeek's format (every 2-D projection weight of the
    layers as e4m3 with a `weight_scale_inv` per block, in two shards with an index), and
    `dequant_dir`, the same weights dequantized in fp32 (what the fp8 checkpoint means)."""
    state = load_file(str(src / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    fp8, plain = {}, {}
    for name, w in state.items():
        quantize = name.startswith("model.layers.") and w.dim() == 2 and "mlp.gate.weight" not in name
        if not quantize:
            fp8[name] = plain[name] = w
            continue
        N, K = w.shape
        bn, bk = block
        rows, cols = -(-N // bn), -(-K // bk)
        padded = torch.zeros(rows * bn, cols * bk)
        padded[:N, :K] = w
        blocks = padded.view(rows, bn, cols, bk)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0          # [rows, cols]
        q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
        fp8[name] = q.view(rows * bn, cols * bk)[:N, :K].contiguous()
        fp8[name + "_scale_inv"] = scale
        plain[name] = (q.float() * scale[:, None, :, None]).view(rows * bn, cols * bk)[:N, :K].contiguous()
    for d in (fp8_dir, dequant_dir):
        d.mkdir(parents=True, exist_ok=True)
    (dequant_dir / "config.json").write_text(json.dumps(cfg))
    save_file(plain, str(dequant_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    (fp8_dir / "config.json").write_text(json.dumps(cfg))
    names = sorted(fp8)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for f, part in shards.items():
        save_file({n: fp8[n] for n in part}, str(fp8_dir / f), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}
    (fp8_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    return fp8_dir, dequant_dir


PAGED_PAGES, PAGED_PAGE_SIZE = 1 + 2 * 12, 4   # paged_logits' pool: the null page, 12 a prompt


def paged_logits(model, cfg, kv: PagedKVCache | None = None) -> torch.Tensor:
    """Logits of two random prompts of 37 tokens fed in chunks (one a single token) into pages of 4
    in shuffled order, in a pool of the model's own layout (or `kv`, of PAGED_PAGES pages)."""
    B, T, ps, per_row = 2, 37, PAGED_PAGE_SIZE, 12
    if kv is None:
        kv = PagedKVCache.allocate(model.kv_layout, PAGED_PAGES, ps, torch.float32, "cpu")
    table = (1 + torch.randperm(B * per_row, generator=torch.Generator().manual_seed(1))).view(B, per_row)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    out = []
    with torch.no_grad():
        for a, b in [(0, 7), (7, 8), (8, 13), (13, 37)]:
            meta = attn_meta(torch.full((B,), a), causal(B, b - a, "cpu"), 40, block_table=table, page_size=ps)
            h, _ = model(ids[:, a:b], torch.arange(a, b)[None].expand(B, b - a), meta, kv.k, kv.v)
            out.append(model.logits(h))
    return torch.cat(out, dim=1)


def our_logits(model, cfg, ids: torch.Tensor, chunks: list[tuple[int, int]]) -> torch.Tensor:
    """Logits of ids [B, T], fed through the cache in chunks [a, b)."""
    B = ids.shape[0]
    kv = KVCache.allocate(cfg.num_layers, B, 64, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu",
                          cfg.v_cache_dim)
    out = []
    with torch.no_grad():
        for a, b in chunks:
            meta = attn_meta(torch.full((B,), a), causal(B, b - a, "cpu"), 64)
            h, _ = model(ids[:, a:b], torch.arange(a, b)[None].expand(B, b - a), meta, kv.k, kv.v)
            out.append(model.logits(h))
    return torch.cat(out, dim=1)
