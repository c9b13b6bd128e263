"""Which slice of every weight a rank holds, and which tensor-parallel sizes a model takes.

At size N rank r holds (Megatron's layout, as vLLM and SGLang shard):
    q_proj rows      the query heads of its KV heads' groups    column-parallel (fused into qkv_proj)
    k_proj, v_proj   a contiguous run of KV heads: Hkv/N each, or where N does not divide Hkv
                     (N <= Hkv) ceil(Hkv/N) on the first Hkv % N ranks and floor on the rest (their
                     query heads follow: SmolLM2's 3 KV heads of 9 at N = 2 are 2 + 1, 6 + 3 query
                     heads); where Hkv < N, KV head r // (N / Hkv), replicated, and H/N query heads
    o_proj columns   the inputs of its query heads            row-parallel: one all-reduce
    gate/up rows     its I/N intermediate rows                 column-parallel (fused into gate_up_proj)
    down columns     the same I/N                              row-parallel: one all-reduce
    embed_tokens, lm_head rows   its ceil(V/N) vocabulary rows (`layers`)
    norms, q/k norms, the drafter   whole
The query heads of a rank all share its KV heads, so attention runs on a rank's heads alone.

MLA (DeepSeek-V3, Kimi K2) splits its H heads evenly, H/N a rank:
    q_a_proj, q_a_layernorm, kv_a_proj_with_mqa, kv_a_layernorm   whole (small): every rank
                     computes the same latent and caches it whole (one latent head per token)
    q_b_proj (q_proj without q-LoRA), kv_b_proj rows   its heads'    column-parallel
    o_proj columns   its heads' values; a bias on rank 0 only   row-parallel: one all-reduce
MoE blocks go expert-parallel:
    router (and the correction bias)   whole, fp32: every rank routes every token alike
    routed experts   E/N whole experts, r * E/N .. (r + 1) * E/N - 1: a rank sums its own
                     experts' outputs, weighted; pairs routed elsewhere add zero
    shared experts   as a dense MLP: gate/up rows and down columns of its S/N intermediate rows
One all-reduce sums a block's routed and shared parts over the ranks. Dense layers of a sparse
model (mlp_only_layers, first_k_dense_replace) shard as a dense model's.
Slices are read from the checkpoint as such (safetensors' `get_slice`; other ranks' experts are
never read): a rank never holds more. A weight stored quantized is sliced as stored
(`loader.packed.part_of`): experts whole; output rows cut packed (or e4m3) rows and scale rows
alike; input columns (o_proj, down_proj) must fall on int4 groups (a multiple of the group size
and of 8: a rank that would cut one is refused, naming the tensor and the size), while an fp8
slice off its blocks' edges is read by the covering blocks and widened, that tensor alone.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from drafttree.config import ModelConfig
from drafttree.parallel.layers import vocab_shard

Select = Callable[[str, list[int]], tuple[slice, ...] | None]


def kv_span(kv_heads: int, world: int, rank: int = 0) -> tuple[int, int]:
    """(first KV head, count) rank `rank` holds: its contiguous run of the KV heads (the first
    kv_heads % world ranks one more), or one replicated head where there are fewer than ranks."""
    if kv_heads < world:
        return rank // (world // kv_heads), 1
    base, extra = divmod(kv_heads, world)
    return rank * base + min(rank, extra), base + (rank < extra)


def kv_heads_per_rank(kv_heads: int, world: int, rank: int = 0) -> int:
    """KV heads a rank holds (and caches). The KV pool's bytes per token follow from this one count
    (rank 0 holds the most; the ranks agree on the fewest pages, `engine`)."""
    return kv_span(kv_heads, world, rank)[1]


def q_span(cfg: ModelConfig, world: int, rank: int = 0) -> tuple[int, int]:
    """(first query head, count) rank `rank` holds: the query heads of its KV heads' groups, or
    H/N where KV heads are replicated."""
    if cfg.num_kv_heads < world:
        h = cfg.num_heads // world
        return rank * h, h
    group = cfg.num_heads // cfg.num_kv_heads
    first, n = kv_span(cfg.num_kv_heads, world, rank)
    return first * group, n * group


def valid_sizes(cfg: ModelConfig, most: int = 64) -> list[int]:
    return [n for n in range(1, most + 1) if not problems(cfg, n)]


def problems(cfg: ModelConfig, world: int) -> list[str]:
    """What `world` ranks cannot split: none of it for a size the model takes."""
    out = []
    kv = cfg.num_kv_heads
    # at most kv ranks split by whole KV groups, evenly or not; more replicate them (MLA's one
    # latent head always: its query heads split evenly)
    if world > kv:
        if cfg.num_heads % world:
            out.append(f"the {cfg.num_heads} attention heads")
        if world % kv:
            out.append(f"the {kv} KV heads (nor is it a multiple of them)")
    if has_dense_mlp(cfg) and cfg.intermediate_size % world:
        out.append(f"the MLP's {cfg.intermediate_size} intermediate rows")
    m = cfg.moe
    if m is not None:
        if m.num_experts % world:
            out.append(f"the {m.num_experts} routed experts")
        shared = m.num_shared * m.intermediate_size
        if shared % world:
            out.append(f"the shared experts' {shared} intermediate rows")
    return out


def has_dense_mlp(cfg: ModelConfig) -> bool:
    """Whether a layer has a dense MLP (of intermediate_size rows), not an MoE block."""
    return cfg.moe is None or len(cfg.moe.sparse_layers) < cfg.num_layers


def check_size(cfg: ModelConfig, world: int) -> None:
    """Refuse a tensor-parallel size the model cannot be split into, naming what it must divide.
    Sizes up to the KV heads split them by whole groups (unevenly where they do not divide);
    larger ones must divide the query heads and be a multiple of the KV heads. A sparse model's
    sizes must also divide its routed experts and its shared experts' rows."""
    if world < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world}")
    bad = problems(cfg, world)
    if bad:
        ok = ", ".join(map(str, valid_sizes(cfg)[:8]))
        raise ValueError(f"tensor_parallel_size {world} does not divide {' and '.join(bad)}; "
                         f"this model takes sizes {ok}")


def head_rows(cfg: ModelConfig, rank: int, world: int) -> tuple[slice, slice]:
    """(query-head rows, KV-head rows) of rank `rank` in q_proj and in k_proj / v_proj."""
    hd = cfg.head_dim
    first_q, h = q_span(cfg, world, rank)
    first_kv, kv = kv_span(cfg.num_kv_heads, world, rank)
    return slice(first_q * hd, (first_q + h) * hd), slice(first_kv * hd, (first_kv + kv) * hd)


def expert_span(num_experts: int, world: int, rank: int = 0) -> tuple[int, int]:
    """(first routed expert, count) rank `rank` holds: a contiguous run of E/N."""
    s = _rows(num_experts, world, rank)
    return s.start, s.stop - s.start


def _rows(total: int, world: int, rank: int) -> slice:
    n = total // world
    return slice(rank * n, (rank + 1) * n)


def selector(cfg: ModelConfig, rank: int, world: int) -> Select:
    """select(name, shape): the slice rank `rank` reads of a Hugging Face tensor, None for whole
    (names with or without the 'model.' prefix). Routed experts saved one tensor per expert are
    whole: the loader reads only its own experts' (`expert_span`)."""
    inter = _rows(cfg.intermediate_size, world, rank)
    rows = vocab_shard(cfg.vocab_size, world)
    vocab = slice(rank * rows, min((rank + 1) * rows, cfg.vocab_size))
    every = slice(None)
    by_suffix = {"mlp.gate_proj.weight": (inter,), "mlp.up_proj.weight": (inter,),
                 "mlp.down_proj.weight": (every, inter),
                 "embed_tokens.weight": (vocab,), "lm_head.weight": (vocab,)}
    by_suffix.update(_mla_slices(cfg, rank, world) if cfg.mla is not None else _attention_slices(cfg, rank, world))
    if cfg.moe is not None:
        m = cfg.moe
        first, n = expert_span(m.num_experts, world, rank)
        experts, shared = slice(first, first + n), _rows(m.num_shared * m.intermediate_size, world, rank)
        by_suffix.update({   # experts saved stacked ([E, ...], transformers' in-memory layout)
            "mlp.experts.gate_up_proj": (experts,), "mlp.experts.down_proj": (experts,),
            "mlp.shared_experts.gate_proj.weight": (shared,), "mlp.shared_experts.up_proj.weight": (shared,),
            "mlp.shared_experts.down_proj.weight": (every, shared)})

    def select(name: str, shape: list[int]) -> tuple[slice, ...] | None:
        return next((s for suffix, s in by_suffix.items() if name.endswith(suffix)), None)
    return select


def _attention_slices(cfg: ModelConfig, rank: int, world: int) -> dict[str, tuple[slice, ...]]:
    q, kv = head_rows(cfg, rank, world)
    return {"self_attn.q_proj.weight": (q,), "self_attn.q_proj.bias": (q,),
            "self_attn.k_proj.weight": (kv,), "self_attn.k_proj.bias": (kv,),
            "self_attn.v_proj.weight": (kv,), "self_attn.v_proj.bias": (kv,),
            "self_attn.o_proj.weight": (slice(None), q)}


def _mla_slices(cfg: ModelConfig, rank: int, world: int) -> dict[str, tuple[slice, ...]]:
    """MLA's per-head projections: rank `rank`'s heads' rows of q_b_proj (or q_proj) and kv_b_proj,
    and their value columns of o_proj. The rest is whole."""
    m = cfg.mla
    first, h = q_span(cfg, world, rank)
    qk, kv = m.qk_nope_head_dim + m.qk_rope_head_dim, m.qk_nope_head_dim + m.v_head_dim
    q = slice(first * qk, (first + h) * qk)
    return {"self_attn.q_proj.weight": (q,), "self_attn.q_b_proj.weight": (q,),
            "self_attn.kv_b_proj.weight": (slice(first * kv, (first + h) * kv),),
            "self_attn.o_proj.weight": (slice(None), slice(first * m.v_head_dim, (first + h) * m.v_head_dim))}


def pad_vocab(t: torch.Tensor, vocab: int, world: int) -> torch.Tensor:
    """A vocabulary shard padded with zero rows to ceil(V / N) rows (only the last rank's is short)."""
    rows = vocab_shard(vocab, world)
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])
