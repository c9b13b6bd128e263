"""Convert a llama-architecture GGUF file into a Hugging Face style model directory.

The output directory holds ``config.json``, ``model.safetensors`` (dequantized
weights with HF tensor names), ``generation_config.json`` and the tokenizer
files. It is built in a temporary sibling directory and renamed into place, so
``out_dir`` either does not exist or is complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from drafttree.loader import gguf_tokenizer
from drafttree.loader.gguf_header import GGUFHeader, Truncated, read_header

GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHITECTURES = ("llama",)

_LAYER_TENSOR_MAP: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSOR_MAP: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Llama 3 style rope frequency factors; transformers recomputes them from rope_scaling.
_IGNORED_TENSORS = {"rope_freqs.weight"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


@dataclass
class LlamaHParams:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: dict[str, Any] | None
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    chat_template: str | None
    tokenizer_model: str | None = None   # tokenizer.ggml.model: "gpt2" (byte-level BPE), "llama" (SentencePiece)


def open_gguf(gguf_path: Path) -> GGUFHeader:
    """Open and sanity-check a GGUF file; raise a clear error naming the file otherwise."""
    gguf_path = Path(gguf_path)
    if not gguf_path.exists():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    if not gguf_path.is_file():
        raise ValueError(f"GGUF path is not a regular file: {gguf_path}")
    with open(gguf_path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(f"{gguf_path} is not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        return read_header(gguf_path)
    except Truncated as exc:
        raise ValueError(f"GGUF file {gguf_path} is corrupt or truncated: {exc}") from exc


def read_llama_hparams(reader: GGUFHeader, gguf_path: Path) -> LlamaHParams:
    arch = reader.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF file {gguf_path} has unsupported architecture {arch!r} "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )

    def req(key: str) -> Any:
        value = reader.get(f"{arch}.{key}")
        if value is None:
            raise ValueError(f"GGUF file {gguf_path} lacks required metadata '{arch}.{key}'")
        return value

    hidden = int(req("embedding_length"))
    n_head = int(req("attention.head_count"))
    n_kv = int(reader.get(f"{arch}.attention.head_count_kv", n_head))
    head_dim = int(reader.get(f"{arch}.attention.key_length", hidden // n_head))
    vocab = reader.get(f"{arch}.vocab_size")
    if vocab is None:
        tokens = reader.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ValueError(f"GGUF file {gguf_path} has neither '{arch}.vocab_size' nor a token list")
        vocab = len(tokens)

    rope_scaling: dict[str, Any] | None = None
    scaling_type = reader.get(f"{arch}.rope.scaling.type")
    scaling_factor = reader.get(f"{arch}.rope.scaling.factor")
    if scaling_type not in (None, "none") and scaling_factor is not None:
        rope_scaling = {"rope_type": str(scaling_type), "factor": float(scaling_factor)}
        orig_ctx = reader.get(f"{arch}.rope.scaling.original_context_length")
        if orig_ctx is not None:
            rope_scaling["original_max_position_embeddings"] = int(orig_ctx)

    def opt_int(key: str) -> int | None:
        value = reader.get(key)
        return None if value is None else int(value)

    return LlamaHParams(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(req("feed_forward_length")),
        num_hidden_layers=int(req("block_count")),
        num_attention_heads=n_head,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        rms_norm_eps=float(reader.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(reader.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(reader.get(f"{arch}.context_length", 2048)),
        rope_scaling=rope_scaling,
        bos_token_id=opt_int("tokenizer.ggml.bos_token_id"),
        eos_token_id=opt_int("tokenizer.ggml.eos_token_id"),
        pad_token_id=opt_int("tokenizer.ggml.padding_token_id"),
        chat_template=reader.get("tokenizer.chat_template"),
        tokenizer_model=reader.get("tokenizer.ggml.model"),
    )


def _unpermute_rope_rows(weights: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter reorders each head's rows from HF's "rotate_half"
    # layout (first half / second half) to interleaved pairs; this is its inverse
    # (same as transformers' LlamaTensorProcessor._reverse_permute_weights).
    half = weights.shape[0] // n_head // 2
    w = weights.reshape(n_head, half, 2, *weights.shape[1:])
    return w.swapaxes(1, 2).reshape(weights.shape)


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _IGNORED_TENSORS:
        return None
    if gguf_name in _GLOBAL_TENSOR_MAP:
        return _GLOBAL_TENSOR_MAP[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_TENSOR_MAP:
        return f"model.layers.{m.group(1)}.{_LAYER_TENSOR_MAP[m.group(2)]}"
    return ""


def convert_tensors(
    reader: GGUFHeader, hp: LlamaHParams, gguf_path: Path, dtype: torch.dtype, bar: tqdm | None = None
) -> dict[str, torch.Tensor]:
    """Dequantize every tensor and return them under HF llama names; ``bar`` advances once per tensor."""
    from gguf.quants import dequantize

    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            if bar is not None:
                bar.update()
            continue
        if name == "":
            raise ValueError(f"GGUF file {gguf_path} has unsupported tensor {t.name!r} for llama")
        try:
            weights = dequantize(t.data, t.tensor_type)
        except (NotImplementedError, ValueError) as exc:
            raise ValueError(
                f"GGUF file {gguf_path}: cannot dequantize {t.name!r} ({t.tensor_type!r}): {exc}"
            ) from exc
        if t.name.endswith("attn_q.weight"):
            weights = _unpermute_rope_rows(weights, hp.num_attention_heads)
        elif t.name.endswith("attn_k.weight"):
            weights = _unpermute_rope_rows(weights, hp.num_key_value_heads)
        out[name] = torch.from_numpy(np.array(weights, dtype=np.float32, order="C", copy=True)).to(dtype)
        if bar is not None:
            bar.update()

    expected = ["model.embed_tokens.weight", "model.norm.weight"] + [
        f"model.layers.{i}.{v}" for i in range(hp.num_hidden_layers) for v in _LAYER_TENSOR_MAP.values()
    ]
    missing = [n for n in expected if n not in out]
    if missing:
        raise ValueError(f"GGUF file {gguf_path} is missing {len(missing)} tensors, e.g. {missing[:3]}")
    return out


def build_config(hp: LlamaHParams, tied: bool, dtype: torch.dtype) -> dict[str, Any]:
    dtype_name = str(dtype).removeprefix("torch.")
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": hp.vocab_size,
        "hidden_size": hp.hidden_size,
        "intermediate_size": hp.intermediate_size,
        "num_hidden_layers": hp.num_hidden_layers,
        "num_attention_heads": hp.num_attention_heads,
        "num_key_value_heads": hp.num_key_value_heads,
        "head_dim": hp.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": hp.rms_norm_eps,
        "rope_theta": hp.rope_theta,
        "max_position_embeddings": hp.max_position_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "bos_token_id": hp.bos_token_id,
        "eos_token_id": hp.eos_token_id,
        "torch_dtype": dtype_name,
    }
    if hp.rope_scaling is not None:
        config["rope_scaling"] = hp.rope_scaling
    if hp.pad_token_id is not None:
        config["pad_token_id"] = hp.pad_token_id
    return config


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n", encoding="utf-8")


def write_tokenizer(gguf_path: Path, out_dir: Path, hp: LlamaHParams, header: GGUFHeader) -> None:
    """Save the GGUF's embedded tokenizer to ``out_dir``: a byte-level BPE vocabulary with GPT-2's
    split built from ``header`` (the metadata already read: `gguf_tokenizer`), any other converted
    by transformers."""
    if gguf_tokenizer.builds(header.fields):
        tok = gguf_tokenizer.build(header.fields)
    else:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast   # (AutoTokenizer's import: seconds)

        # A byte-level BPE vocabulary is the class AutoTokenizer resolves it to, without first
        # reading the whole file again for the model's config.
        cls = PreTrainedTokenizerFast if hp.tokenizer_model == "gpt2" else AutoTokenizer
        tok = cls.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if hp.chat_template:
        tok.chat_template = hp.chat_template
    tok.save_pretrained(str(out_dir))
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.exists() else {}
    if hp.chat_template:
        cfg["chat_template"] = hp.chat_template
        # A separate chat_template.jinja would take precedence; keep a single source.
        (out_dir / "chat_template.jinja").unlink(missing_ok=True)
    cfg["model_max_length"] = hp.max_position_embeddings
    for key in ("is_local", "local_files_only"):
        cfg.pop(key, None)
    _write_json(cfg_path, cfg)


def convert_gguf_to_hf(
    gguf_path: Path,
    out_dir: Path,
    dtype: torch.dtype = torch.float32,
    *,
    with_tokenizer: bool = True,
    progress: bool = True,
) -> Path:
    """Convert ``gguf_path`` into an HF llama directory at ``out_dir`` and return ``out_dir``.

    An existing ``out_dir`` is replaced. On any failure nothing is left behind. ``progress`` shows a
    bar on stderr, one step per tensor, whose status names the slow steps around them (reading the
    metadata, writing the weights, converting the tokenizer).
    """
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    # No rate in the bar: the slow steps after the last tensor would make it meaningless.
    fmt = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} tensors [{elapsed}{postfix}]"
    with tqdm(desc=f"converting {gguf_path.name}", file=sys.stderr, disable=not progress, dynamic_ncols=True,
              bar_format=fmt) as bar:
        bar.set_postfix_str("reading metadata")
        reader = open_gguf(gguf_path)
        hp = read_llama_hparams(reader, gguf_path)
        bar.reset(total=len(reader.tensors))
        bar.set_postfix_str("dequantizing")
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp_dir = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp_dir.mkdir()
        try:
            _write_model_dir(reader, hp, gguf_path, tmp_dir, dtype, with_tokenizer, bar)
            _replace_dir(tmp_dir, out_dir)
        except BaseException:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            raise
        bar.set_postfix_str("done")
    return out_dir


def _write_model_dir(reader: GGUFHeader, hp: LlamaHParams, gguf_path: Path, out_dir: Path, dtype: torch.dtype,
                     with_tokenizer: bool, bar: tqdm) -> None:
    from safetensors.torch import save_file

    tensors = convert_tensors(reader, hp, gguf_path, dtype, bar)
    tied = "lm_head.weight" not in tensors
    bar.set_postfix_str("writing model.safetensors")
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out_dir / "model.safetensors", 0o644)
    del tensors
    _write_json(out_dir / "config.json", build_config(hp, tied, dtype))
    gen: dict[str, Any] = {"bos_token_id": hp.bos_token_id, "eos_token_id": hp.eos_token_id}
    if hp.pad_token_id is not None:
        gen["pad_token_id"] = hp.pad_token_id
    _write_json(out_dir / "generation_config.json", gen)
    if with_tokenizer:
        bar.set_postfix_str("converting the tokenizer")
        write_tokenizer(gguf_path, out_dir, hp, reader)


def _replace_dir(src: Path, dst: Path) -> None:
    """Atomically move the finished ``src`` to ``dst``, replacing an older ``dst``."""
    if dst.exists():
        old = dst.parent / f".{dst.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)
