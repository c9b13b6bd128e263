"""The memory plan of each GPU, before anything loads: whether the weights fit and how much KV
cache is left.

Per rank, from the configs alone: the weights by kind in the bytes they take on that rank as the
checkpoint stores them (int4 packed words and group scales for compressed-tensors
`pack-quantized` modules, e4m3 and a fp32 scale per block for fp8 checkpoints, the model's dtype
for the rest and for the modules the quantization_config ignores; routers fp32), sharded as
`parallel.shard` shards them; the KV bytes per token (`KVLayout`: MLA's latent whole on every
rank, the drafter's whole); the CUDA graphs' activation pools (`graph_plan`'s estimate, as
`Engine._kv_budget` sets it aside) and a stated allowance for the CUDA context and workspaces;
then the pool the engine would size (`Engine._size_pool`: the ranks agree on the fewest pages).

Pure: no CUDA call and no weights. The caller gives the device's total memory
(`torch.cuda.mem_get_info`'s, `--gpu-memory-gb`'s, or `ASSUMED_DEVICE`, an H200's) and the
resolved sizes (`plan_memory`), so that the engine can refuse a start-up that cannot fit before
it reads a byte (`MemoryPlan.check`). The engine's own plan comes from its resolved setup
(`plan_for_setup`; random-weight shapes plan their experts in the form they draw them in):
on CUDA it is logged at start-up, and weights that cannot fit are refused there (`startup_plan`).
"""
from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from drafttree.config import DTYPES, ModelConfig, parse_dtype
from drafttree.engine.config import EngineConfig
from drafttree.loader import quantization
from drafttree.loader.quantization import FP8, Quantization
from drafttree.models.dflash import DFlashConfig
from drafttree.models.dflash2 import DFlash2Config
from drafttree.models.kv_cache import KVLayout
from drafttree.parallel.layers import vocab_shard
from drafttree.parallel.shard import check_size, expert_span, kv_heads_per_rank, q_span, valid_sizes
from drafttree.phases import SpecConfig
from drafttree.runner.cuda_graph import graph_plan
from drafttree.runner.model_runner import CacheConfig
from drafttree.runner.phase_table import CAPTURED_MODES
from drafttree.runner.round_buffers import round_buffer_bytes
from drafttree.sampling import SampleMode

if TYPE_CHECKING:
    from drafttree.engine.plan import EngineSetup

log = logging.getLogger(__name__)

GiB = 1 << 30
KINDS = ("attention", "dense MLP", "shared experts", "routed experts", "embedding + LM head", "router / norms",
         "drafter")
# Set aside beside the weights on every GPU: the CUDA context, cuBLAS and Triton workspaces and the
# allocator's slack; and over a tensor-parallel group NCCL's buffers.
CONTEXT_GIB = 1.0
NCCL_GIB = 0.5
# The engine's KV budget without gpu_memory_utilization or kv_cache_memory_gb: this share of the
# memory free once the weights are in (`pool_sizing.kv_budget`); on the CPU a fixed size.
DEFAULT_FREE_SHARE = 0.6
CPU_KV_GIB = 1.0


@dataclass(frozen=True)
class Device:
    """The memory of one GPU the plan is for, and where the figure comes from."""
    total_bytes: int
    source: str

    @classmethod
    def of(cls, gpu_memory_gb: float | None = None, cuda_total: int | None = None) -> "Device":
        """--gpu-memory-gb (GiB) if given, else this machine's CUDA device's total (the caller's
        `torch.cuda.mem_get_info()[1]`), else `ASSUMED_DEVICE`."""
        if gpu_memory_gb is not None:
            if not gpu_memory_gb > 0:
                raise ValueError(f"--gpu-memory-gb must be > 0, got {gpu_memory_gb}")
            return cls(int(gpu_memory_gb * GiB), "--gpu-memory-gb")
        if cuda_total is not None:
            return cls(int(cuda_total), "this machine's CUDA device (torch.cuda.mem_get_info)")
        return ASSUMED_DEVICE


# An H200 is sold as 141 GB; CUDA reports a little under 140 GiB of it, and 139 is planned.
ASSUMED_DEVICE = Device(139 * GiB, "assumed: an H200 (141 GB, about 139 GiB usable); no CUDA device here, "
                                   "--gpu-memory-gb plans another")


# -- how the checkpoint stores its matrices ---------------------------------------------------------

@dataclass(frozen=True)
class WeightFormat:
    """How a checkpoint stores its matrices, as the loader reads its `quantization_config`
    (`loader.quantization`): int4 (compressed-tensors `pack-quantized`: int32 words of 8 values and
    a scale per `group_size` inputs) for the Linear modules its config groups cover, or fp8 (e4m3,
    a fp32 scale per `block`) for every Linear of the layers but the routers, less
    `modules_to_not_convert` (the checkpoint's own tensors say which; the config cannot)."""
    quant: Quantization
    scale_bytes: int = 2
    prefix: str = ""                    # the checkpoint's names' prefix ('language_model.' in a wrapper)
    not_converted: tuple[str, ...] = ()   # fp8: modules_to_not_convert

    @property
    def method(self) -> str:
        return self.quant.method

    @property
    def group_size(self) -> int:
        """int4: the (first) config group's size; 0 for fp8."""
        return self.quant.groups[0].group_size if self.quant.groups else 0

    @property
    def block(self) -> tuple[int, int]:
        return self.quant.block

    def group_of(self, name: str) -> int | None:
        """int4: the group size the Linear module `name` (HF's name, 'model.layers.3.mlp.experts.7.up_proj')
        is stored in, None where it stays 16-bit; fp8: its block's rows (any int), or None."""
        full = self.prefix + name
        if self.method == FP8:
            return self.block[0] if ".layers." in full and not any(p in full for p in self.not_converted) else None
        return self.quant.group_size(full)

    def quantizes(self, name: str) -> bool:
        return self.group_of(name) is not None

    def bytes(self, name: str, rows: int, cols: int) -> int:
        """Bytes of the quantized module `name` of shape [rows, cols], as stored."""
        if self.method == FP8:
            return rows * cols + -(-rows // self.block[0]) * -(-cols // self.block[1]) * 4
        return rows * -(-cols // 8) * 4 + rows * -(-cols // self.group_of(name)) * self.scale_bytes

    def describe(self) -> str:
        if self.method == FP8:
            return f"fp8 e4m3 with a fp32 scale per {self.block[0]} x {self.block[1]} block"
        return (f"int4 (compressed-tensors pack-quantized: int32 words of 8 values, a {8 * self.scale_bytes}-bit "
                f"scale per {self.group_size} inputs of a row)")


def weight_format(raw: dict[str, Any] | None) -> WeightFormat | None:
    """The quantization a config.json declares (its own, or its text_config's in a multimodal
    wrapper), None for none; refuses, as the loader does, a form drafttree does not load."""
    if not raw:
        return None
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) and "hidden_size" not in raw else None
    q = (text or {}).get("quantization_config") or raw.get("quantization_config")
    if not q:
        return None
    quant = quantization.parse({"quantization_config": q})
    prefix = "language_model." if text is not None else ""
    if quant.method == FP8:
        return WeightFormat(quant, prefix=prefix, not_converted=tuple(q.get("modules_to_not_convert") or ()))
    w = next(iter((q.get("config_groups") or {}).values()), {}).get("weights") or {}
    scale = DTYPES.get(w.get("scale_dtype") or (text or raw).get("torch_dtype") or (text or raw).get("dtype")
                       or "bfloat16", torch.bfloat16)
    return WeightFormat(quant, _size(scale), prefix)


def read_config(path: str | Path) -> dict[str, Any]:
    """A model directory's config.json, as written (`weight_format` reads its quantization)."""
    return json.loads((Path(path) / "config.json").read_text())


# -- what one rank holds --------------------------------------------------------------------------

@dataclass(frozen=True)
class _Part:
    kind: str
    shape: tuple[int, ...]
    names: tuple[str, ...] = ()   # Linear modules of this shape, by checkpoint name: quantization may
                                  # store them packed; none: one tensor (a norm, a bias, an embedding)
    fp32: bool = False        # routers
    fp8_rows: bool = False    # the drafter's fp8 projections: a byte a value, a fp32 scale per row


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _mlp(kind: str, prefixes: list[str], D: int, inter: int) -> list[_Part]:
    """SwiGLU MLPs' three matrices at `inter` intermediate rows (this rank's), one MLP per prefix."""
    return [_Part(kind, (inter, D), tuple(p + "gate_proj" for p in prefixes)),
            _Part(kind, (inter, D), tuple(p + "up_proj" for p in prefixes)),
            _Part(kind, (D, inter), tuple(p + "down_proj" for p in prefixes))]


def _attention(cfg: ModelConfig, p: str, world: int, rank: int) -> list[_Part]:
    """This rank's attention (`models.layers.Attention`, `models.mla.MLAttention`), by the
    checkpoint's modules: the heads it holds, MLA's latent path whole."""
    D, h, a = cfg.hidden_size, q_span(cfg, world, rank)[1], "attention"
    bias = cfg.attention_bias
    m = cfg.mla
    if m is None:
        hd, kv = cfg.head_dim, kv_heads_per_rank(cfg.num_kv_heads, world, rank)
        out = [_Part(a, (h * hd, D), (p + "q_proj",)), _Part(a, (kv * hd, D), (p + "k_proj",)),
               _Part(a, (kv * hd, D), (p + "v_proj",)), _Part(a, (D, h * hd), (p + "o_proj",))]
        out += [_Part(a, ((h + 2 * kv) * hd,))] if bias else []
        return out + ([_Part(a, (hd,)), _Part(a, (hd,))] if cfg.qk_norm else [])
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    if m.q_lora_rank is None:
        out = [_Part(a, (h * qk, D), (p + "q_proj",))]
    else:
        out = [_Part(a, (m.q_lora_rank, D), (p + "q_a_proj",)), _Part(a, (m.q_lora_rank,)),
               _Part(a, (h * qk, m.q_lora_rank), (p + "q_b_proj",))] + ([_Part(a, (m.q_lora_rank,))] if bias else [])
    out += [_Part(a, (m.cache_dim, D), (p + "kv_a_proj_with_mqa",)), _Part(a, (m.kv_lora_rank,)),
            _Part(a, (h * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank), (p + "kv_b_proj",)),
            _Part(a, (D, h * m.v_head_dim), (p + "o_proj",))]
    if bias:   # kv_a_proj's, and o_proj's on rank 0 alone (row-parallel: added once)
        out += [_Part(a, (m.cache_dim,))] + ([_Part(a, (D,))] if rank == 0 else [])
    return out


def _layer(cfg: ModelConfig, i: int, world: int, rank: int) -> list[_Part]:
    p, D, m = f"model.layers.{i}.", cfg.hidden_size, cfg.moe
    norms = [_Part("router / norms", (D,)), _Part("router / norms", (D,))]
    out = norms + _attention(cfg, p + "self_attn.", world, rank)
    if m is None or i not in m.sparse_layers:
        return out + _mlp("dense MLP", [p + "mlp."], D, cfg.intermediate_size // world)
    out.append(_Part("router / norms", (m.num_experts, D), fp32=True))
    if m.scoring == "sigmoid":
        out.append(_Part("router / norms", (m.num_experts,), fp32=True))
    first, n = expert_span(m.num_experts, world, rank)
    out += _mlp("routed experts", [f"{p}mlp.experts.{j}." for j in range(first, first + n)], D, m.intermediate_size)
    if m.num_shared:
        out += _mlp("shared experts", [p + "mlp.shared_experts."], D, m.num_shared * m.intermediate_size // world)
    return out


def _target(cfg: ModelConfig, world: int, rank: int) -> list[_Part]:
    rows, D, e = vocab_shard(cfg.vocab_size, world), cfg.hidden_size, "embedding + LM head"
    out = [_Part(e, (rows, D))] + ([] if cfg.tie_word_embeddings else [_Part(e, (rows, D), ("lm_head",))])
    for i in range(cfg.num_layers):
        out += _layer(cfg, i, world, rank)
    return out + [_Part("router / norms", (D,))]


def _drafter(d: DFlashConfig, quantization: str | None, head_rows: int) -> list[_Part]:
    """The DFlash drafter, whole on every rank: fc, its layers (`DecoderLayer`), norms; with
    `draft_quantization` fp8 its projections become e4m3 with a fp32 scale per row
    (`models.quant`), and it keeps an e4m3 copy of this rank's LM head rows."""
    m, k = d.model, "drafter"
    D, hd, H, kv, inter = m.hidden_size, m.head_dim, m.num_heads, m.num_kv_heads, m.intermediate_size
    fp8 = quantization == "fp8"

    def proj(rows: int, cols: int) -> _Part:
        return _Part(k, (rows, cols), fp8_rows=fp8)
    out = [proj(D, len(d.target_layer_ids) * D), _Part(k, (D,)), _Part(k, (D,))]
    for _ in range(m.num_layers):
        out += [_Part(k, (D,)), _Part(k, (D,)), proj((H + 2 * kv) * hd, D), proj(D, H * hd), proj(2 * inter, D),
                proj(D, inter)]
        out += ([_Part(k, ((H + 2 * kv) * hd,))] if m.attention_bias else []) + \
            ([_Part(k, (hd,)), _Part(k, (hd,))] if m.qk_norm else [])
    if isinstance(d, DFlash2Config):   # its convolutions and selector stay in the drafter's dtype
        G, r = d.conv_groups, d.selector_rank
        out += [_Part(k, (2, d.conv_kernel_size, D)), _Part(k, (2 * d.conv_kernel_size * G, D))] * (2 * m.num_layers)
        out += [_Part(k, (m.vocab_size, r)), _Part(k, (m.vocab_size, r)), _Part(k, (r, D))]
    return out + ([proj(head_rows, D)] if fp8 else [])


def _bytes(part: _Part, fmt: WeightFormat | None, dtype_bytes: int) -> int:
    numel = 1
    for s in part.shape:
        numel *= s
    if part.fp8_rows:
        return numel + part.shape[0] * 4
    plain = numel * (4 if part.fp32 else dtype_bytes)
    if not part.names:
        return plain
    if fmt is None:
        return len(part.names) * plain
    return sum(fmt.bytes(n, *part.shape) if fmt.quantizes(n) else plain for n in part.names)


def rank_weights(cfg: ModelConfig, fmt: WeightFormat | None, dtype: torch.dtype, world: int = 1, rank: int = 0,
                 drafter: DFlashConfig | None = None, draft_quantization: str | None = None) -> dict[str, int]:
    """Bytes by kind (`KINDS`) that rank `rank` of `world` holds."""
    out = dict.fromkeys(KINDS, 0)
    b = _size(dtype)
    parts = _target(cfg, world, rank)
    if drafter is not None:
        parts += _drafter(drafter, draft_quantization, vocab_shard(cfg.vocab_size, world))
    for part in parts:
        out[part.kind] += _bytes(part, fmt, b)
    return out


def quantized_kinds(cfg: ModelConfig, fmt: WeightFormat) -> list[str]:
    """The kinds of which `fmt` stores some module quantized (rank 0 of one: every module)."""
    return [k for k in KINDS if any(p.kind == k and any(map(fmt.quantizes, p.names)) for p in _target(cfg, 1, 0))]


# -- the plan ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RankMemory:
    """One rank's share (or several ranks' alike)."""
    ranks: tuple[int, ...]
    weights: dict[str, int]          # bytes by kind
    kv_bytes_per_token: int          # the target's and the drafter's caches
    target_kv_bytes_per_token: int
    kv_budget: int                   # bytes its KV pool may take
    pages: int                       # pages its budget holds (the null page among them)

    @property
    def weight_bytes(self) -> int:
        return sum(self.weights.values())

    @property
    def label(self) -> str:
        r = self.ranks
        if len(r) == 1:
            return f"rank {r[0]}"
        if r == tuple(range(r[0], r[-1] + 1)):
            return f"ranks {r[0]}-{r[-1]}"
        return "ranks " + ",".join(map(str, r))


@dataclass(frozen=True)
class MemoryPlan:
    model: str                       # what was planned, in words
    world: int
    dtype: torch.dtype
    device: Device
    weight_format: str               # how the weights are stored, in words
    context_bytes: int               # the allowance beside the weights
    graph_bytes: int                 # the CUDA graphs' activation pools (estimate)
    buffer_bytes: int                # the rounds' per-row buffers (`runner.round_buffers`), exact
    budget_source: str
    page_size: int
    max_model_len: int
    max_num_seqs: int
    kv_headroom: int                 # slots a round writes past a request's committed length
    ranks: tuple[RankMemory, ...]    # distinct shares, rank 0's first
    suggestions: tuple[str, ...] = field(default=())   # other tensor-parallel sizes' weights, when they do not fit
    max_model_len_given: bool = True   # False: the model's max_position_embeddings, which the engine
                                       # lowers (with a warning) to what its pool holds

    @property
    def pages(self) -> int:
        """Pages every rank's pool holds: the fewest (the ranks name pages by rank 0's ids)."""
        return min(r.pages for r in self.ranks)

    @property
    def kv_tokens(self) -> int:
        """Tokens the KV pool holds on each GPU (the null page left out)."""
        return max(self.pages - 1, 0) * self.page_size

    @property
    def pool_pages(self) -> int:
        """Pages the engine allocates (`pool_sizing.size_pool`): what the budget holds, at most what
        max_num_seqs requests at the context it reaches need (the null page included)."""
        reach = min(self.max_model_len, self.longest_context) + self.kv_headroom
        return max(min(self.pages, 1 + self.max_num_seqs * -(-reach // self.page_size)), 0)

    def pool_bytes(self, rank: RankMemory) -> int:
        """Bytes of a rank's KV pools (the target's and the drafter's) at `pool_pages`."""
        return self.pool_pages * self.page_size * rank.kv_bytes_per_token

    @property
    def request_pages(self) -> int:
        """Pages one request at max_model_len holds, with a round's headroom."""
        return -(-(self.max_model_len + self.kv_headroom) // self.page_size)

    @property
    def requests_at_max_len(self) -> int:
        return max(self.pages - 1, 0) // self.request_pages

    @property
    def longest_context(self) -> int:
        """The longest context one request can reach in the pool."""
        return max(self.kv_tokens - self.kv_headroom, 0)

    def weights_fit(self) -> bool:
        return all(r.weight_bytes + self.context_bytes <= self.device.total_bytes for r in self.ranks)

    def overcommitted(self) -> bool:
        """Whether weights, allowance, graphs and the KV pool together exceed the device (a
        kv_cache_memory_gb larger than what is left)."""
        return any(r.weight_bytes + self.context_bytes + self.graph_bytes + self.buffer_bytes + r.kv_budget
                   > self.device.total_bytes for r in self.ranks)

    def fits(self) -> bool:
        return self.weights_fit() and not self.overcommitted() and self.requests_at_max_len >= 1

    def problem(self) -> str | None:
        """What does not fit and what to change; None when one request at max_model_len fits."""
        gib = self.device.total_bytes / GiB
        if not self.weights_fit():
            r = max(self.ranks, key=lambda r: r.weight_bytes)
            tail = ("; " + "; ".join(self.suggestions)) if self.suggestions else ""
            return (f"the weights alone take {r.weight_bytes / GiB:.2f} GiB per GPU ({r.label}; routed experts "
                    f"{r.weights['routed experts'] / GiB:.2f} GiB) and the CUDA context "
                    f"{self.context_bytes / GiB:.2f} GiB, more than the device's {gib:.2f} GiB: shard over more GPUs "
                    f"(-tp), use a quantized checkpoint (int4 or fp8 routed experts), or plan for a larger device "
                    f"(--gpu-memory-gb){tail}")
        if self.overcommitted():
            return (f"the KV pool ({self.budget_source}) does not fit beside the weights on a {gib:.2f} GiB device: "
                    f"lower --kv-cache-memory-gb, or give --gpu-memory-utilization instead")
        if self.longest_context < 16:   # the engine's floor (`Engine._size_pool`)
            return (f"the KV cache gets {min(r.kv_budget for r in self.ranks) / GiB:.2f} GiB per GPU "
                    f"({self.budget_source}), {self.kv_tokens:,} tokens: raise --gpu-memory-utilization, "
                    f"give --kv-cache-memory-gb, or shard over more GPUs (-tp)")
        if self.requests_at_max_len < 1:
            whose = "" if self.max_model_len_given else \
                "; that is the model's length, which the engine would lower to what fits, with a warning"
            return (f"the KV cache left holds {self.kv_tokens:,} tokens per GPU, under one request at max_model_len "
                    f"{self.max_model_len:,} (+ {self.kv_headroom} slots a round writes ahead){whose}: "
                    f"--max-model-len {self.longest_context:,} or less fits; or raise --gpu-memory-utilization, or "
                    f"shard over more GPUs (-tp)")
        return None

    def check(self) -> None:
        """Refuse a plan whose weights do not fit or whose KV cache cannot hold one request at
        max_model_len: ValueError with the table and what to change."""
        if self.problem() is not None:
            raise ValueError(self.format())   # its last line: what does not fit, and what to change

    def format(self) -> str:
        """The plan as a table: GiB per kind and per rank, the KV tokens, the verdict."""
        label_w, col_w = 30, 16

        def row(label: str, cells: list[str], note: str = "") -> str:
            return f"  {label:<{label_w}}" + "".join(f"{c:>{col_w}}" for c in cells) + (f"   {note}" if note else "")

        def gib(n: int) -> str:
            return f"{n / GiB:.2f} GiB"

        rs = self.ranks
        lines = [f"memory per GPU: {self.model}, tensor_parallel_size {self.world}, "
                 f"{str(self.dtype).removeprefix('torch.')}",
                 f"  device: {gib(self.device.total_bytes)}, {self.device.source}",
                 f"  weights as stored: {self.weight_format}",
                 row("", [r.label for r in rs])]
        lines += [row(k, [gib(r.weights[k]) if r.weights[k] else "-" for r in rs]) for k in KINDS]
        lines += [row("weights", [gib(r.weight_bytes) for r in rs]),
                  row("CUDA context, workspaces", [gib(self.context_bytes)] * len(rs), "allowance"),
                  row("CUDA graph pools", [gib(self.graph_bytes) if self.graph_bytes else "-"] * len(rs),
                      "estimate (graph_plan)" if self.graph_bytes else "no CUDA graphs"),
                  row("round buffers", [gib(self.buffer_bytes)] * len(rs),
                      f"{self.max_num_seqs} rows: round state, grammar masks, logits processing"),
                  row("KV budget", [gib(r.kv_budget) for r in rs], self.budget_source),
                  row("KV bytes per token", [f"{r.kv_bytes_per_token:,}" for r in rs],
                      "target + drafter" if any(r.kv_bytes_per_token != r.target_kv_bytes_per_token for r in rs)
                      else ""),
                  row("KV tokens", [f"{max(r.pages - 1, 0) * self.page_size:,}" for r in rs],
                      f"pages of {self.page_size}" + (f"; every rank's pool holds the fewest: {self.kv_tokens:,}"
                                                      if len(rs) > 1 else "")),
                  row("KV pool allocated", [gib(self.pool_bytes(r)) for r in rs],
                      f"{self.pool_pages:,} pages: the budget's, at most what max_num_seqs requests need")]
        need = self.max_num_seqs * self.request_pages * self.page_size
        bad = self.problem()
        if bad is not None:
            lines.append(f"does not fit: {bad}")
        else:
            all_fit = self.requests_at_max_len >= self.max_num_seqs
            lines.append(f"fits: {self.kv_tokens:,} KV tokens per GPU; max_num_seqs {self.max_num_seqs} requests at "
                         f"max_model_len {self.max_model_len:,} need {need:,}: "
                         + ("all fit (the pool takes only the pages they need)" if all_fit else
                            f"{self.requests_at_max_len} fit at full length (the rest wait for pages or run shorter)"))
        return "\n".join(lines)


def after_pool_bytes(target: ModelConfig, drafter: DFlashConfig | None, spec: SpecConfig, max_num_seqs: int,
                     max_len: int, page_size: int, dtype: torch.dtype, world: int, cuda_graphs: bool,
                     graph_modes: tuple[SampleMode, ...] = CAPTURED_MODES, structured_graphs: bool = True,
                     processed_graphs: bool = True, graph_len: int | None = None) -> tuple[int, int]:
    """(the CUDA graphs' pool, estimated; the rounds' per-row buffers, exact): what the engine
    allocates after its KV pool, so that a budget of the device's memory sets them aside first
    (the plan here, `pool_sizing.kv_budget` at start-up). The graphs are those the engine
    captures: its sampler modes, the constrained and processed rounds' if it captures them, its
    KV buckets up to `graph_len` tokens (default: max_len)."""
    graphs = 0
    if cuda_graphs:
        entries = graph_plan(spec, target, drafter.model if drafter else None, max_num_seqs,
                             [min(graph_len or max_len, max_len)], world, graph_modes, structured_graphs,
                             processed_graphs)
        graphs = max((e.est_bytes for e in entries), default=0)   # the graphs share one pool
    layers = len(drafter.target_layer_ids) if drafter is not None else 0
    pages_per_row = CacheConfig(max_num_seqs, max_len, spec.kv_headroom, page_size).pages_per_row
    return graphs, round_buffer_bytes(target, spec, layers, max_num_seqs, pages_per_row, dtype)


def setup_graphs(setup: EngineSetup) -> dict[str, Any]:
    """`after_pool_bytes`' graph choices of an engine's setup (what `prepare.capture_graphs` captures)."""
    cfg = setup.cfg
    return {"cuda_graphs": setup.cuda_graphs, "graph_modes": setup.sampler_modes,
            "structured_graphs": setup.structured_graphs, "processed_graphs": setup.processed_graphs,
            "graph_len": None if cfg.max_graph_len is None else cfg.max_graph_len + setup.spec.kv_headroom}


def plan_memory(target: ModelConfig, raw: dict[str, Any] | None = None, drafter: DFlashConfig | None = None, *,
                spec: SpecConfig | None = None, tensor_parallel_size: int = 1, max_model_len: int | None = None,
                max_num_seqs: int = 256, page_size: int = 16, dtype: torch.dtype = torch.bfloat16,
                device: Device = ASSUMED_DEVICE, gpu_memory_utilization: float | None = None,
                kv_cache_memory_gb: float | None = None, draft_quantization: str | None = None,
                cuda_graphs: bool = True, context_gib: float | None = None,
                graph_modes: tuple[SampleMode, ...] = CAPTURED_MODES, structured_graphs: bool = True,
                processed_graphs: bool = True, graph_len: int | None = None) -> MemoryPlan:
    """The plan of every rank, from the engine's resolved sizes: the target's config (and its
    config.json as written, `raw`, for the quantization), the drafter's with its `spec` (a spec
    that does not speculate drops the drafter, as the engine does), and the pool's sizes. The KV
    budget follows `Engine._kv_budget`: kv_cache_memory_gb (GiB), or gpu_memory_utilization of the
    device less the weights, the allowance and the graphs' estimate, or 60 % of what the weights
    leave. `context_gib`: the allowance (default CONTEXT_GIB, and NCCL_GIB over several ranks).
    Start-up can refuse on `check()` before loading, or, where max_model_len was not given, lower
    the context to `longest_context` as `Engine._size_pool` does."""
    world = tensor_parallel_size
    check_size(target, world)
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if gpu_memory_utilization is not None and kv_cache_memory_gb is not None:
        raise ValueError("give kv_cache_memory_gb or gpu_memory_utilization, not both")
    if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if draft_quantization not in (None, "fp8"):
        raise ValueError(f"unknown draft quantization {draft_quantization!r}; choose one of ['fp8']")
    if drafter is not None and spec is None:
        raise ValueError("a drafter's memory plan needs its spec (engine.plan.resolve_spec)")
    spec = spec or SpecConfig()
    if spec.speculative and drafter is None:
        raise ValueError(f"spec {spec.method!r} needs a drafter")
    drafter = drafter if spec.speculative else None
    if drafter is not None:
        drafter.check_fits(target)
    max_len = max_model_len or target.max_position_embeddings
    fmt = weight_format(raw)
    total = device.total_bytes
    if context_gib is None:
        context_gib = CONTEXT_GIB + (NCCL_GIB if world > 1 else 0.0)
    context = int(context_gib * GiB)
    graphs, buffers = after_pool_bytes(target, drafter, spec, max_num_seqs, max_len, page_size, dtype, world,
                                       cuda_graphs, graph_modes, structured_graphs, processed_graphs, graph_len)
    draft_kv = KVLayout.of(drafter.model).bytes_per_token(dtype) if drafter is not None else 0
    shares: dict[tuple, list[int]] = {}
    for rank in range(world):
        w = rank_weights(target, fmt, dtype, world, rank, drafter, draft_quantization)
        kv = KVLayout.of(target, world, rank).bytes_per_token(dtype)
        shares.setdefault((tuple(w.items()), kv), []).append(rank)
    if kv_cache_memory_gb is not None:
        source = f"kv_cache_memory_gb {kv_cache_memory_gb}"
    elif gpu_memory_utilization is not None:
        source = f"gpu_memory_utilization {gpu_memory_utilization} of the device, less the above"
    else:
        source = f"the default: {DEFAULT_FREE_SHARE:.0%} of what the weights and the context leave"
    ranks = []
    for (w, kv), members in shares.items():
        used = sum(n for _, n in w) + context
        if kv_cache_memory_gb is not None:
            budget = int(kv_cache_memory_gb * GiB)
        elif gpu_memory_utilization is not None:
            budget = max(int(gpu_memory_utilization * total) - used - graphs - buffers, 0)
        else:
            budget = max(int(DEFAULT_FREE_SHARE * (total - used)), 0)
        bpt = kv + draft_kv
        ranks.append(RankMemory(tuple(members), dict(w), bpt, kv, budget, budget // (bpt * page_size)))
    what = f"{target.arch}, {target.num_layers} layers" + (f", drafter {drafter.model.num_layers} layers"
                                                            if drafter is not None else "")
    stored = f"{', '.join(quantized_kinds(target, fmt)) or 'nothing'} {fmt.describe()}; the rest " \
        if fmt is not None else "all "
    stored += f"{str(dtype).removeprefix('torch.')}" + ("; routers fp32" if target.moe is not None else "")
    if draft_quantization and drafter is not None:
        stored += "; drafter fp8 (a fp32 scale per row) with an fp8 copy of the LM head rows"
    plan = MemoryPlan(what, world, dtype, device, stored, context, graphs, buffers, source, page_size, max_len,
                      max_num_seqs, spec.kv_headroom, tuple(ranks), max_model_len_given=max_model_len is not None)
    if plan.weights_fit():
        return plan
    return dataclasses.replace(plan, suggestions=_other_sizes(target, fmt, dtype, world, drafter, draft_quantization,
                                                               total - context))


def _other_sizes(cfg: ModelConfig, fmt: WeightFormat | None, dtype: torch.dtype, world: int,
                 drafter: DFlashConfig | None, draft_quantization: str | None, room: int) -> tuple[str, ...]:
    """The smallest larger tensor-parallel size whose rank 0 holds its weights in `room`, if any."""
    for n in valid_sizes(cfg):
        if n <= world:
            continue
        held = sum(rank_weights(cfg, fmt, dtype, n, 0, drafter, draft_quantization).values())
        if held <= room:
            return (f"at -tp {n} the weights take {held / GiB:.2f} GiB per GPU",)
    return ("no tensor-parallel size this model takes holds them",)


def plan_for(cfg: EngineConfig, model_dir: str | Path, target: ModelConfig, drafter: DFlashConfig | None,
             spec: SpecConfig, device: Device | None = None) -> MemoryPlan:
    """`plan_memory` with an EngineConfig's sizes, for a CUDA device (dtype auto: bf16), weight-free:
    `model_dir` needs its config.json only."""
    return plan_memory(target, read_config(model_dir), drafter, spec=spec,
                       tensor_parallel_size=cfg.tensor_parallel_size, max_model_len=cfg.max_model_len,
                       max_num_seqs=cfg.max_num_seqs, page_size=cfg.page_size, dtype=parse_dtype(cfg.dtype, "cuda"),
                       device=device or ASSUMED_DEVICE, gpu_memory_utilization=cfg.gpu_memory_utilization,
                       kv_cache_memory_gb=cfg.kv_cache_memory_gb, draft_quantization=cfg.draft_quantization,
                       cuda_graphs=cfg.cuda_graphs is not False)


# -- the engine's plan, from its resolved setup -----------------------------------------------------

# the modules a random shape draws in a stored form: its routed experts (`models.random_shapes`)
ROUTED_EXPERTS = r"re:.*\.mlp\.experts\.\d+\.(gate|up|down)_proj$"


def shape_quantization(form: str | None) -> dict[str, Any] | None:
    """The config.json a checkpoint would hold for a random shape whose routed experts are drawn in
    `form` ('int4', 'fp8': `models.random_shapes.EXPERT_FORMS`; None: 16-bit), for `weight_format`:
    only the routed experts stored so."""
    if form is None:
        return None
    from drafttree.models.random_shapes import EXPERT_FORMS

    layout = EXPERT_FORMS[form][1]
    if form == "fp8":
        return {"quantization_config": {
            "quant_method": "fp8", "weight_block_size": list(layout["block"]),
            "modules_to_not_convert": ["self_attn", "shared_experts", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]}}
    scale = str(layout["scale_dtype"]).removeprefix("torch.")
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
               "group_size": layout["group_size"], "scale_dtype": scale}
    return {"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                    "config_groups": {"experts": {"targets": [ROUTED_EXPERTS], "weights": weights}}}}


def plan_for_setup(setup: EngineSetup, device: Device) -> MemoryPlan:
    """The plan of an engine's resolved setup on GPUs of `device`: its model (a checkpoint's
    config.json, or a random shape in the form it draws), dtype, drafter, ranks and pool sizes,
    the KV budget taken as `pool_sizing.kv_budget` takes it (on the CPU its fixed default)."""
    cfg = setup.cfg
    if setup.model_dir is not None:
        raw = read_config(setup.model_dir)
    else:
        from drafttree.models.random_shapes import parse_shape
        raw = shape_quantization(parse_shape(cfg.random_weights)[2])
    kv_gb = cfg.kv_cache_memory_gb
    if kv_gb is None and setup.device.type != "cuda":
        kv_gb = CPU_KV_GIB
    return plan_memory(setup.target, raw, setup.drafter, spec=setup.spec, tensor_parallel_size=setup.world,
                       max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs, page_size=cfg.page_size,
                       dtype=setup.dtype, device=device, gpu_memory_utilization=cfg.gpu_memory_utilization,
                       kv_cache_memory_gb=kv_gb, **setup_graphs(setup),
                       draft_quantization=cfg.draft_quantization if setup.drafter is not None else None)


def startup_device(setup: EngineSetup) -> Device | None:
    """The device an engine's start-up plans for: its CUDA device's total memory; None elsewhere
    (a CPU engine's memory is the host's, which the plan does not describe)."""
    if setup.device.type != "cuda":
        return None
    return Device.of(cuda_total=torch.cuda.mem_get_info(setup.device)[1])


def startup_plan(setup: EngineSetup, device: Device | None = None) -> MemoryPlan | None:
    """The plan an engine starts with, before it reads a weight (the engine logs it): refused
    (ValueError with the table) where the weights alone do not fit the device. `device` None: the engine's
    own (`startup_device`); None is returned where there is none. A setup the plan cannot
    describe (a quantization it does not know) starts without one, with a warning: the loader
    decides then. A context longer than the pool holds is not refused here: the engine lowers
    it with a warning (`pool_sizing.size_pool`)."""
    device = device or startup_device(setup)
    if device is None:
        return None
    try:
        plan = plan_for_setup(setup, device)
    except ValueError as e:
        log.warning("no memory plan at start-up: %s", e)
        return None
    if not plan.weights_fit():
        raise ValueError(plan.format())
    return plan
