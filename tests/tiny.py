"""Random tiny Hugging Face checkpoints (targets and DFlash drafters) written for the tests; the
targets are `drafttree.tiny_target`'s, which benchmarks use too."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from drafttree.tiny_target import SHAPES, make_target  # noqa: F401  (the tests' names for them)


def make_drafter(path: Path, target_dir: Path, block_size: int = 4, layers: int = 2, seed: int = 1,
                 target_layer_ids: list[int] | None = None, hidden: int | None = None,
                 vocab: int | None = None, head_dim: int = 8, arch: str = "dflash") -> Path:
    """Write a random drafter in the published DFlash format for `target_dir`; `arch="dflash2"`:
    in the published DFlash2 format (convolutions of 2 taps over groups of 4 channels, a selector
    of rank 8 over the top 4 candidates, all random, the convolutions near the identity)."""
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
    if arch == "dflash2":
        taps, group, rank = 2, 4, 8
        cfg["architectures"] = ["DFlash2DraftModel"]
        cfg["dflash_config"].update(conv_kernel_size=taps, conv_group_size=group, selector_rank=rank, selector_top_k=4)
        identity = torch.zeros(2, taps, D)
        identity[:, 0] = 1.0
        for i in range(layers):
            for conv in ("attention_conv", "mlp_conv"):
                w[f"layers.{i}.{conv}.base_kernel"] = identity + r(2, taps, D)
                w[f"layers.{i}.{conv}.kernel_projection.weight"] = r(2 * taps * D // group, D)
        w.update({"candidate_selector.predecessor_codebook": r(V, rank) * 5,
                  "candidate_selector.successor_codebook": r(V, rank) * 5,
                  "candidate_selector.hidden_projection.weight": r(rank, D) * 5})
    elif arch != "dflash":
        raise ValueError(f"arch must be dflash or dflash2, got {arch!r}")
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


def write_tokenizer(path: Path, vocab: int, eos_token: str | None = None, chat_template: str | None = None,
                    added: tuple[str, ...] = (), special: bool = False) -> Path:
    """A character-level tokenizer of `vocab` ids beside a tiny checkpoint, so that text prompts
    (the CLI's) reach it: id 0 unknown, then printable ASCII, then fillers. By default no EOS token
    and no chat template, so a prompt is its characters and only max_tokens ends a generation.
    `added`: whole tokens in the last ids (markers such as `<think>`), special ones with `special`
    (left out of text decoded without special tokens)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>"] + [chr(c) for c in range(32, 127)]
    pieces = (pieces + [f"<extra_{i}>" for i in range(max(vocab - len(pieces), 0))])[:vocab]
    if added:
        pieces[len(pieces) - len(added):] = list(added)
    tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    if added:
        tok.add_tokens([AddedToken(a, special=special, normalized=False) for a in added])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    if eos_token is not None:
        fast.eos_token = eos_token
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(str(path))
    return path
