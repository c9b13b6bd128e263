"""Which slice of every weight a rank holds, and which tensor-parallel sizes a model takes.

At size N rank r holds (Megatron's layout, as vLLM and SGLang shard):
    q_proj rows      its H/N query heads, r * H/N ..          column-parallel (fused into qkv_proj)
    k_proj, v_proj   its Hkv/N KV heads; where Hkv < N, KV head r // (N / Hkv), replicated
    o_proj columns   the inputs of its query heads            row-parallel: one all-reduce
    gate/up rows     its I/N intermediate rows                 column-parallel (fused into gate_up_proj)
    down columns     the same I/N                              row-parallel: one all-reduce
    embed_tokens, lm_head rows   its ceil(V/N) vocabulary rows (`layers`)
    norms, q/k norms, the drafter   whole
The query heads of a rank all share its KV heads, so attention runs on a rank's heads alone.
Slices are read from the checkpoint as such (safetensors' `get_slice`): a rank never holds more.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from drafttree.config import ModelConfig
from drafttree.parallel.layers import vocab_shard

Select = Callable[[str, list[int]], tuple[slice, ...] | None]


def kv_heads_per_rank(kv_heads: int, world: int) -> int:
    """KV heads a rank holds (and caches): its share, or one replicated head where there are
    fewer KV heads than ranks. The KV pool's bytes per token follow from this one count."""
    return max(kv_heads // world, 1)


def valid_sizes(cfg: ModelConfig, most: int = 64) -> list[int]:
    return [n for n in range(1, most + 1) if not problems(cfg, n)]


def problems(cfg: ModelConfig, world: int) -> list[str]:
    out = []
    if cfg.num_heads % world:
        out.append(f"the {cfg.num_heads} attention heads")
    kv = cfg.num_kv_heads
    if kv % world and world % kv:
        out.append(f"the {kv} KV heads (nor is it a multiple of them)")
    if cfg.intermediate_size % world:
        out.append(f"the MLP's {cfg.intermediate_size} intermediate rows")
    return out


def unsupported_sparse(cfg: ModelConfig) -> str:
    what = " and ".join(n for n, part in (("MoE", cfg.moe), ("MLA", cfg.mla)) if part is not None) or "MoE/MLA"
    return (f"tensor parallelism for MoE and MLA targets is not supported yet: this {cfg.arch} model has "
            f"{what} layers; run it with tensor_parallel_size 1")


def check_size(cfg: ModelConfig, world: int) -> None:
    """Refuse a tensor-parallel size the model cannot be split into, naming what it must divide,
    and any size > 1 for MoE and MLA targets (not sharded yet)."""
    if world < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world}")
    if world > 1 and cfg.sparse:
        raise ValueError(unsupported_sparse(cfg))
    bad = problems(cfg, world)
    if bad:
        ok = ", ".join(map(str, valid_sizes(cfg)[:8]))
        raise ValueError(f"tensor_parallel_size {world} does not divide {' and '.join(bad)}; "
                         f"this model takes sizes {ok}")


def head_rows(cfg: ModelConfig, rank: int, world: int) -> tuple[slice, slice]:
    """(query-head rows, KV-head rows) of rank `rank` in q_proj and in k_proj / v_proj."""
    hd, h = cfg.head_dim, cfg.num_heads // world
    kv = kv_heads_per_rank(cfg.num_kv_heads, world)
    first_kv = rank * kv if cfg.num_kv_heads >= world else rank // (world // cfg.num_kv_heads)
    return slice(rank * h * hd, (rank + 1) * h * hd), slice(first_kv * hd, (first_kv + kv) * hd)


def selector(cfg: ModelConfig, rank: int, world: int) -> Select:
    """select(name, shape): the slice rank `rank` reads of a Hugging Face tensor, None for whole."""
    q, kv = head_rows(cfg, rank, world)
    i = cfg.intermediate_size // world
    inter = slice(rank * i, (rank + 1) * i)
    rows = vocab_shard(cfg.vocab_size, world)
    vocab = slice(rank * rows, min((rank + 1) * rows, cfg.vocab_size))
    every = slice(None)
    by_suffix = {
        "self_attn.q_proj.weight": (q,), "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.weight": (kv,), "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.weight": (kv,), "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.weight": (every, q),
        "mlp.gate_proj.weight": (inter,), "mlp.up_proj.weight": (inter,),
        "mlp.down_proj.weight": (every, inter),
        "embed_tokens.weight": (vocab,), "lm_head.weight": (vocab,),
    }

    def select(name: str, shape: list[int]) -> tuple[slice, ...] | None:
        return next((s for suffix, s in by_suffix.items() if name.endswith(suffix)), None)
    return select


def pad_vocab(t: torch.Tensor, vocab: int, world: int) -> torch.Tensor:
    """A vocabulary shard padded with zero rows to ceil(V / N) rows (only the last rank's is short)."""
    rows = vocab_shard(vocab, world)
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])
