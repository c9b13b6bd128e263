"""Every hand-written kernel, and when it runs instead of its torch fallback (`torch_ops`).

Model and spec code call these functions, never a kernel module; each decides by device, dtype,
shape and the settings (`drafttree.settings`, DRAFTTREE_*). "Triton" below means CUDA with
triton installed, or Triton's interpreter (TRITON_INTERPRET=1, tests on CPU); "dots" means
Triton where `tl.dot` runs (on CUDA, Ampere or newer).

    attention          few_row_attention (attn_kernel)
                       runs: `attn_kernel` set, dots, head dim a power of two >= 16, CUDA, at most
                             FEW_ROWS query rows per KV head (decode, draft, verify)
                       else: two matmuls around a fused softmax (those few rows), SDPA (prefill)
    rope_attention     q/k norm, rope, KV write and attention in one launch (attn_kernel)
                       runs: as attention, one token per row (`rope_in_attention`)
    qk_rope_write_kv   q/k norm, rope and KV write in one launch (rope_kernel)
                       runs: `attn_kernel` set, dots, head dim as attention;  else: torch ops
    write_kv           KV write in one launch (attn_kernel)
                       runs: as qk_rope_write_kv;  else: indexed assignment
    norm_gemv, gemv,   one row: the GEMVs (gemv_kernel); 2 to 64 rows: tensor-core tiles (gemm_kernel)
    norm_glu_gemv      runs where `projection_kernels`: `gemv` set, 16-bit, no autograd, Triton, and
                             for more than one row `gemm` set and dots
                       else: the caller's unfused layers; a weight class whose tiles lost to cuBLAS
                             (no blocks) takes torch_ops.projection
    int4_linear        int4 weights kept packed (compressed-tensors pack-quantized, int4_ops), W4A16
                       runs: `tiles_take`: int4_kernel (one row the GEMV, more the tensor-core tiles),
                             unpacked in registers; deterministic mode: the tiles at fixed blocks
                       else: the torch form (the weight unpacked, then matmul)
    int4_experts       grouped W4A16 GEMMs over expert-sorted pairs (moe_align, int4_moe_kernel)
                       runs where `moe_kernels`; any row count
                       else: the torch forms: each pair's expert unpacked (CPU, or few pairs), every
                             expert unpacked once over every row (CUDA, more pairs)
                       both: group sizes `int4_kernel.check_group` takes (powers of two from 8 that
                             divide the inputs), else a ValueError on every path
    fp8_block_linear   e4m3 weights with a scale per 128 x 128 block, kept as stored (fp8_block_ops),
                       weight-only: e4m3 tiles widened in registers, each block's partial dot scaled
                       in fp32 (fp8_block_kernel), any row count
                       runs where `fp8_block_kernels`: 16-bit, no autograd, dots, e4m3 conversion
                             (`fp8_runs_on`: compute capability 8.9 or newer), block width a
                             multiple of 16
                       else: the torch forms (widened to x's dtype, then matmul)
    fp8_block_experts  the same for routed experts: `moe_experts`' grouped GEMMs over fp8 blocks
                       (moe_align, fp8_block_moe)
                       runs where `moe_kernels` and `fp8_block_kernels`;  else: the torch forms
    fp8_linear         fp8 weight tiles (gemm_kernel)
                       runs: `gemm` set, 16-bit, dots (`tiles_take`);  else: weights widened, cuBLAS
    moe_experts        routed experts as grouped GEMMs over expert-sorted pairs (moe_align, moe_kernel)
                       runs where `moe_kernels`: `moe_kernel` set, 16-bit, no autograd, dots; any
                             row count (decode, draft, verify, prefill chunks)
                       else: `models.moe.Experts`' torch forms (gathered, all experts, sorted)
    top_log_probs      vocabulary top-K and normalizer in two launches (topk_kernel)
                       runs: CUDA with Triton, k <= MAX_FUSED_TOPK;  else: torch topk
    build_tree_fused   the DDTree build after the top-K, one launch (tree_kernel)
                       runs: spec's tree_builder asks `fused_tree_usable` (Triton, budget <= 128);
                       else: spec.tree.build_tree
    filter_thresholds  top-k / top-p threshold by a radix descent (filter_kernel)
                       runs: CUDA dots, vocabulary < 2^19;  else: a sort

Deterministic mode (`settings.deterministic`, where `invariant`: no autograd, 16-bit or fp32, dots):
every projection of any row count takes the tiles with blocks and input splits fixed per weight
(gemm_kernel.INVARIANT_BLOCKS), attention `invariant_attn` at any width, the norms outside the
projections `norm_kernel`, the LM head the tiles, and one-token decodes do not fold rope into
attention: a token's logits are then the same bits in every phase and batch.

Under CUDA graphs each choice is made once, at capture: they depend on shapes and settings only.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from drafttree.kernels import attn_kernel, filter_kernel, gemm_kernel, gemv_kernel, invariant_attn, moe_kernel
from drafttree.kernels import fp8_block_kernel, fp8_block_moe
from drafttree.kernels import fp8_block_ops, int4_ops, norm_kernel, rope_kernel, topk_kernel, torch_ops, tree_kernel
from drafttree.kernels import int4_kernel, int4_moe_kernel
from drafttree.kernels.attn_kernel import Rope
from drafttree.kernels.tree_kernel import TreeTensors
from drafttree.kernels.triton_jit import capability, dots_run_on, interpreting, kernels_run_on, next_pow2
from drafttree.settings import current

__all__ = ["FEW_ROWS", "MAX_FUSED_TOPK", "Rope", "TreeTensors", "add_rms_norm", "attention", "attention_kernels",
           "build_tree_fused", "few_rows", "filter_thresholds", "fp8_block_experts", "fp8_block_kernels",
           "fp8_block_linear", "fp8_linear", "fp8_runs_on", "fused_tree_usable", "gemv", "int4_experts",
           "int4_linear", "invariant", "linear", "moe_experts", "moe_kernels", "norm_gemv", "norm_glu_gemv",
           "projection_kernels", "qk_rope_write_kv", "rms_norm", "rope_attention", "rope_in_attention",
           "tiles_take", "top_log_probs", "write_kv"]


def invariant(x: torch.Tensor) -> bool:
    """Whether a forward over x runs in deterministic mode (module docstring): `settings.deterministic`,
    no autograd, 16-bit or fp32, and Triton's dots on x's device."""
    return (current().deterministic and not torch.is_grad_enabled()
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and dots_run_on(x.device))

# -- attention, rope and the KV write --------------------------------------------------------------

# Query rows (query heads per KV head x tokens) up to which CUDA attention takes the few-row path
# (the Triton kernel, else two matmuls around a fused softmax) instead of SDPA. 256 covers DDTree's
# verify at budget 32 with 4 query heads per KV head (132 rows, Qwen3-8B).
FEW_ROWS = 256


def few_rows(x: torch.Tensor, rows: int) -> bool:
    """Whether attention with `rows` query rows per KV head takes the few-query-row path (decode,
    draft, verify on CUDA)."""
    return x.is_cuda and rows <= FEW_ROWS


def attention_kernels(x: torch.Tensor, head_dim: int | None = None) -> bool:
    """Whether the attention kernels (attention, rope + KV write, KV write) run for x [..., hd] (or
    any tensor on the device, with `head_dim`): `settings.attn_kernel`, dots on x's device, and a
    head dim `tl.dot` takes (a power of two, at least 16)."""
    hd = x.shape[-1] if head_dim is None else head_dim
    return current().attn_kernel and hd >= 16 and hd == next_pow2(hd) and dots_run_on(x.device)


def rope_in_attention(qkv: torch.Tensor, head_dim: int, group: int) -> bool:
    """Whether a forward takes `rope_attention`: one token per row (a decode), few rows (`group`
    query heads per KV head). A wider forward would redo each query row's
    rope once per split (a DDTree verify at budget 32 lost more than decode gained)."""
    return attention_kernels(qkv, head_dim) and qkv.shape[1] == 1 and few_rows(qkv, group) and not invariant(qkv)


def rope_attention(qkv: torch.Tensor, heads: int, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                   scale: float, rope: Rope, kv_slots: torch.Tensor | None = None) -> torch.Tensor:
    """`attn_kernel.rope_attention` (only where `rope_in_attention`): [B, W, H, hd]."""
    return attn_kernel.rope_attention(qkv, heads, k, v, mask, scale, rope, kv_slots)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Caches [rows, Hkv, max_len, hd]; k, v [B, W, Hkv, hd] go to cache[rows[b], :, slots[b, i]]."""
    if attention_kernels(k) and k.stride(-1) == 1 and v.stride(-1) == 1:
        attn_kernel.write_kv(k_cache, v_cache, rows, slots, k, v)
    else:
        torch_ops.write_kv(k_cache, v_cache, rows, slots, k, v)


def qk_rope_write_kv(qkv: torch.Tensor, heads: int, kv_heads: int, q_weight: torch.Tensor | None,
                     k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
                     slots: torch.Tensor) -> torch.Tensor:
    """qkv [B, W, (H + 2 Hkv) * hd] -> q [B, W, H, hd], normed (with weights, Qwen3) and roped; k
    (normed, roped) and v written to cache[rows[b], :, slots[b, i]]. cos, sin [B, W, 1, hd]."""
    if attention_kernels(qkv, qkv.shape[-1] // (heads + 2 * kv_heads)) or invariant(qkv):
        return rope_kernel.qk_rope_write_kv(qkv, heads, kv_heads, q_weight, k_weight, eps, cos, sin, k_cache,
                                            v_cache, rows, slots)
    q, k, v = torch_ops.qk_rope(qkv, heads, kv_heads, q_weight, k_weight, eps, cos, sin)
    write_kv(k_cache, v_cache, rows, slots, k, v)
    return q


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
              grouped_mask: Callable[[int], torch.Tensor], kv_slots: torch.Tensor | None = None,
              visible: Callable[[], invariant_attn.Visible] | None = None) -> torch.Tensor:
    """softmax(q kᵀ * scale, masked) v: q [B, W, H, hd]; k, v [B, Hkv, L, hd] (views of the cache),
    or paged the pools [1, Hkv, slots, hd] read at kv_slots [B, L] (the kernel follows the slots;
    the torch ops gather a copy); mask [B, 1, W, L] bool; grouped_mask(g): the mask with g query
    heads folded into its rows (made once per forward, for the torch ops); visible(): each token's
    keys in order (`invariant_attn.visible_keys`, made once per forward; deterministic mode). -> [B, W, H * hd]."""
    B, W, H, hd = q.shape
    if visible is not None and invariant(q):   # (targets whose heads it cannot take are refused at start)
        return invariant_attn.attention(q, k, v, visible(), scale, kv_slots).view(B, W, H * hd)
    g = H // k.shape[1]
    few = few_rows(q, g * W)
    if few and attention_kernels(q):
        return attn_kernel.few_row_attention(q, k, v, mask, scale, kv_slots).view(B, W, H * hd)
    if kv_slots is not None:
        k, v = torch_ops.gather_slots(k, kv_slots), torch_ops.gather_slots(v, kv_slots)
    return torch_ops.attention(q, k, v, grouped_mask(g), scale, few)


# -- projections -----------------------------------------------------------------------------------


def _runs_16bit(x: torch.Tensor) -> bool:
    """No autograd (the kernels have no backward: a drafter's training keeps the torch ops),
    16-bit (fp32 keeps cuBLAS everywhere: decode and verify then sum alike), Triton on x's device."""
    return not torch.is_grad_enabled() and x.dtype in (torch.bfloat16, torch.float16) and kernels_run_on(x.device)


def tiles_take(x: torch.Tensor) -> bool:
    """Whether x's rows may go through the few-row tiles: `settings.gemm`, 16-bit, dots."""
    return current().gemm and _runs_16bit(x) and dots_run_on(x.device)


def projection_kernels(x: torch.Tensor) -> bool:
    """Whether a forward over x [B, W, D] takes the fused projections (`norm_gemv`, `gemv`,
    `norm_glu_gemv`) instead of the unfused layers: `settings.gemv`, 16-bit, and one token row
    (the GEMVs) or 2 to gemm_kernel.MAX_ROWS rows where the tiles may run."""
    rows = x.numel() // x.shape[-1]
    if invariant(x):
        return True
    if not (current().gemv and _runs_16bit(x)):
        return False
    return rows == 1 or (rows <= gemm_kernel.MAX_ROWS and tiles_take(x))


def _project(kind: str, x: torch.Tensor, delta: torch.Tensor | None, g: torch.Tensor | None, eps: float,
             w: torch.Tensor, b: torch.Tensor | None, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    inv = invariant(x)
    rows = gemv_kernel.check(kind, x, w, any_rows=inv)
    if scale is None and inv:
        return gemm_kernel.launch(kind, x, delta, g, eps, w, b, invariant=True)
    if scale is not None:   # fp8 weights: the tiles at any rows (the torch ops have no weight-only fp8 product)
        return gemm_kernel.launch(kind, x, delta, g, eps, w, b, scale)
    if rows == 1:
        return gemv_kernel.launch(kind, x, delta, g, eps, w, b)
    if gemm_kernel.tiles_cover(kind, w.numel(), rows):
        return gemm_kernel.launch(kind, x, delta, g, eps, w, b)
    return torch_ops.projection(kind, x, delta, g, eps, w, b)


def norm_gemv(x: torch.Tensor, delta: torch.Tensor | None, g: torch.Tensor, eps: float, w: torch.Tensor,
              b: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, (rmsnorm(x + delta) * g) @ w.T + b) for x [..., K] of up to gemm_kernel.MAX_ROWS
    rows (where `projection_kernels`); w [N, K] (fp8 with `scale` [N]: `quant.Fp8Linear`'s)."""
    return _project("norm", x, delta, g, eps, w, b, scale)


def gemv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
         scale: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T + b for x [..., K] of up to gemm_kernel.MAX_ROWS rows; w [N, K] (scale: as norm_gemv)."""
    return _project("plain", x, None, None, 0.0, w, b, scale)[1]


def norm_glu_gemv(x: torch.Tensor, delta: torch.Tensor | None, g: torch.Tensor, eps: float,
                  w: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, silu(gate) * up) for [gate | up] = norm_gemv(x, delta, g, eps, w)[1], w [2I, K]:
    a program owns gate rows n and up rows I + n, so SiLU·up is its epilogue."""
    return _project("glu", x, delta, g, eps, w, None, scale)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T (an LM head): the tiles in deterministic mode, else cuBLAS."""
    if invariant(x):
        return gemv(x, w)
    return F.linear(x, w)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., D] (`norm_kernel` in deterministic mode, else the torch ops)."""
    if invariant(x):
        return norm_kernel.add_rms_norm(x, None, weight, eps)[1]
    return torch_ops.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, RMSNorm of it), as `rms_norm` chooses."""
    if invariant(x):
        return norm_kernel.add_rms_norm(x, delta, weight, eps)
    return torch_ops.add_rms_norm(x, delta, weight, eps)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, scale: torch.Tensor) -> torch.Tensor:
    """x @ (w * scale[:, None]).T + b for e4m3 weights w [N, K]: the fp8 tiles where x's rows may
    take tiles, else the weights widened for the torch ops."""
    if tiles_take(x):
        return gemm_kernel.launch("plain", x, None, None, 0.0, w, b, scale)[1]
    return torch_ops.fp8_linear(x, w, scale, b)


def fp8_runs_on(device: torch.device | str) -> bool:
    """Whether fp8 weights can be used on `device`: CUDA needs Triton's e4m3 conversion (compute
    capability 8.9 or newer); elsewhere the weights are widened for the torch ops."""
    dev = torch.device(device)
    return dev.type != "cuda" or interpreting() or (kernels_run_on(dev) and capability(dev) >= (8, 9))


# -- mixture-of-experts ----------------------------------------------------------------------------


def moe_kernels(x: torch.Tensor) -> bool:
    """Whether routed experts over x [N, D] take the grouped GEMMs (`moe_experts`):
    `settings.moe_kernel`, 16-bit, no autograd, dots on x's device; at every row count. They read
    each expert hit once per tile of its pairs, where the gathered form copies the weights per
    pair, the all-experts form reads every expert and the sorted form reads its counts back: on an
    H200, a Qwen3-30B-A3B layer at 1, 16, 33 and 528 rows took 1.2-2.8x less time than the best
    torch form (benchmarks/moe_kernel_bench.py). fp32 (CPU runs, the lossless tests) keeps the
    torch forms."""
    return current().moe_kernel and _runs_16bit(x) and dots_run_on(x.device)


def moe_experts(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, dropless: bool = True) -> torch.Tensor:
    """Σ_k w[n, k] · expert_idx[n, k](x[n]) for x [N, D], w and idx [N, k]; gate_up [E, 2I, D],
    down [E, D, I] (only where `moe_kernels`); dropless=False: ids may be E, pairs to skip."""
    return moe_kernel.fused_experts(x, w, idx, gate_up, down, dropless=dropless)


# -- int4 weights (compressed-tensors pack-quantized) ----------------------------------------------


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, group_size: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W.T + bias for an int4 weight W [N, K] kept packed (`int4_ops`: packed [N, K / 8],
    scale [N, K / G]): the W4A16 kernels where `tiles_take`, fixed tiles in deterministic mode,
    else the torch form."""
    int4_kernel.check_group(group_size, x.shape[-1])
    if invariant(x):
        return int4_kernel.linear(x, packed, scale, group_size, bias, blocks=int4_kernel.INVARIANT_BLOCKS)
    if tiles_take(x):
        return int4_kernel.linear(x, packed, scale, group_size, bias)
    return int4_ops.linear(x, packed, scale, group_size, bias)


# (token, k) pairs up to which the torch forms unpack each pair's expert on CUDA (a transient of
# that many experts); more unpack every expert once (`int4_ops.experts_all`). CPU keeps the first.
INT4_GATHER_MAX_PAIRS = 16


def int4_experts(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, gate_up: torch.Tensor,
                 gate_up_scale: torch.Tensor, down: torch.Tensor, down_scale: torch.Tensor, group_size: int,
                 dropless: bool = True) -> torch.Tensor:
    """`moe_experts` with int4 experts kept packed: gate_up [E, 2I, D / 8], down [E, D, I / 8] and
    their scales: the grouped W4A16 GEMMs where `moe_kernels`, else the torch forms (`int4_ops`);
    dropless=False: ids may be E, pairs to skip."""
    int4_kernel.check_group(group_size, x.shape[-1])
    int4_kernel.check_group(group_size, down.shape[-1] * int4_ops.PACK)
    if moe_kernels(x):
        return int4_moe_kernel.fused_experts(x, w, idx, gate_up, gate_up_scale, down, down_scale, group_size,
                                             dropless=dropless)
    if x.is_cuda and idx.numel() > INT4_GATHER_MAX_PAIRS:
        return int4_ops.experts_all(x, w, idx, gate_up, gate_up_scale, down, down_scale, group_size)
    return int4_ops.experts(x, w, idx, gate_up, gate_up_scale, down, down_scale, group_size)


# -- fp8 weights in blocks (DeepSeek-V3 / Kimi K2 checkpoints) ------------------------------------


def fp8_block_kernels(x: torch.Tensor, block: tuple[int, int]) -> bool:
    """Whether products of x with fp8 weights in `block`s take the kernels (`fp8_block_kernel`,
    `fp8_block_moe`): 16-bit, no autograd, dots and e4m3 conversion on x's device, and a block
    width the kernels' input steps divide (a multiple of 16)."""
    return (_runs_16bit(x) and dots_run_on(x.device) and fp8_runs_on(x.device)
            and block[1] % fp8_block_kernel.MIN_BK == 0)


def fp8_block_linear(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W.T for an e4m3 weight W [N, K] with one scale per block (`fp8_block_ops`):
    the kernel where `fp8_block_kernels`, else the torch form."""
    if fp8_block_kernels(x, block):
        return fp8_block_kernel.linear(x, w, scale_inv, block, bias)
    return fp8_block_ops.linear(x, w, scale_inv, block, bias)


def fp8_block_experts(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, gate_up: torch.Tensor,
                      gate_up_scale: torch.Tensor, down: torch.Tensor, down_scale: torch.Tensor,
                      block: tuple[int, int], dropless: bool = True) -> torch.Tensor:
    """`moe_experts` with e4m3 experts in scaled blocks: the grouped GEMMs (`fp8_block_moe`) where
    `moe_kernels` and `fp8_block_kernels`, else the torch form (`fp8_block_ops.experts`);
    dropless=False: ids may be E, pairs to skip."""
    if moe_kernels(x) and fp8_block_kernels(x, block):
        return fp8_block_moe.fused_experts(x, w, idx, gate_up, gate_up_scale, down, down_scale, block,
                                           dropless=dropless)
    return fp8_block_ops.experts(x, w, idx, gate_up, gate_up_scale, down, down_scale, block)


# -- the draft tree --------------------------------------------------------------------------------

# Largest k for which the two-launch Triton top-K replaces the torch ops.
MAX_FUSED_TOPK = 128


def top_log_probs(draft_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best tokens per position and their log-probabilities, [R, L, k] each, descending."""
    if draft_logits.is_cuda and k <= MAX_FUSED_TOPK and kernels_run_on(draft_logits.device):
        return topk_kernel.top_log_probs_fused(draft_logits, k, interpret=interpreting())
    return torch_ops.top_log_probs(draft_logits, k)


def fused_tree_usable(device: torch.device | str, budget: int) -> bool:
    """Whether the DDTree build should be `build_tree_fused` (Triton on `device`, and budget <=
    tree_kernel.MAX_FUSED_BUDGET, where it beat `spec_decode.tree.build_tree`)."""
    return tree_kernel.available(device, budget)


def build_tree_fused(draft_logits: torch.Tensor, root_tokens: torch.Tensor, budget: int) -> TreeTensors:
    """`spec_decode.tree.build_tree`'s tree, as its fields, in one kernel after the vocabulary top-K (only
    where `fused_tree_usable`): draft_logits [R, L, V], root_tokens [R]."""
    R, L, V = draft_logits.shape
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    if L < 1:
        raise ValueError("draft_logits needs at least one position")
    top_lp, top_idx = top_log_probs(draft_logits, min(budget, V))   # the same scores as build_tree, bit for bit
    return tree_kernel.build(top_lp, top_idx, root_tokens, budget)


# -- sampling --------------------------------------------------------------------------------------


def filter_thresholds(logits: torch.Tensor, temp: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor) -> torch.Tensor:
    """`sampling.filter_thresholds`: on CUDA where the kernel's int8 products run (Ampere or
    newer), a radix descent without a sort; else the sort."""
    if logits.is_cuda and dots_run_on(logits.device) and logits.shape[-1] < filter_kernel.MAX_VOCAB:
        return filter_kernel.filter_thresholds_fused(logits, temp, top_k, top_p, interpret=interpreting())
    return torch_ops.thresholds_by_sort(logits, temp, top_k, top_p)
