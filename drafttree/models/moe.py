"""The mixture-of-experts MLP: a router, routed experts stacked [E, ...], optional shared experts.

Decode, draft and verify forwards run on static shapes without a host sync, so that they can be
captured in CUDA graphs: no `nonzero`, no per-expert token counts read back. An eager prefill
sorts its (token, k) pairs by expert and reads the counts back once (`Experts.sorted`).

Over a tensor-parallel group the block is expert-parallel (`parallel.shard`): every rank routes
every token alike (the router is whole), runs the same forms over its own E/N experts only, the
pairs routed to other ranks' experts weighing zero, adds its slice of the shared experts, and one
all-reduce sums the ranks' parts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from drafttree.kernels import dispatch
from drafttree.kernels.torch_ops import local_pairs, sigmoid_route, silu_mul
from drafttree.models.layers import MLP
from drafttree.moe_config import MoEConfig
from drafttree.parallel.comm import all_reduce
from drafttree.parallel.group import TPGroup
from drafttree.parallel.shard import expert_span

# Token rows from which an eager forward sorts its pairs by expert (a prefill chunk); below, and
# inside a graph capture, the static forms run.
SORTED_MIN_ROWS = 256
# values in one expert group's intermediates in `Experts.all_experts` (128 MiB in bf16)
ALL_EXPERTS_ELEMENTS = 1 << 26

# (token, k) pairs up to which the experts may be gathered: the copy is a transient of this many
# experts' weights (1.4 GB for Kimi K2's in bf16 at 16), so a decode of one or two tokens.
GATHER_MAX_PAIRS = 16


def gathers(rows: int, top_k: int, num_experts: int) -> bool:
    """Whether the experts run by gathering each (token, k) pair's weights (`Experts.gathered`)
    rather than every expert over every row (`Experts.all_experts`). The gather copies the picked
    experts (a read, a write and a read of each pair's weights), the loop reads every expert once:
    so gather while 3 * rows * k <= E, and within GATHER_MAX_PAIRS. Both are static shapes; where
    the grouped GEMMs run (`dispatch.moe_kernels`) neither is used."""
    pairs = rows * top_k
    return 3 * pairs <= num_experts and pairs <= GATHER_MAX_PAIRS


class Router(nn.Module):
    """Top-k routing as the config says. Its weight and DeepSeek's correction bias stay fp32 (as in
    the reference), so the picks do not move with the model's dtype."""

    def __init__(self, hidden: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.zeros(moe.num_experts, hidden))
        # DeepSeek-V3's e_score_correction_bias: moves the selection only, never the weights
        self.bias = nn.Parameter(torch.zeros(moe.num_experts)) if moe.scoring == "sigmoid" else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> (weights [N, k] fp32, expert ids [N, k] long)."""
        m = self.moe
        if m.scoring == "softmax":   # Qwen3-MoE: logits in the model's dtype, softmax in fp32
            probs = F.linear(x, self.weight.to(x.dtype)).float().softmax(dim=-1)
            w, idx = probs.topk(m.top_k, dim=-1)
            if m.norm_topk_prob:
                w = w / w.sum(dim=-1, keepdim=True)
            return w, idx
        return sigmoid_route(F.linear(x.float(), self.weight.float()), self.bias.float(), m.top_k, m.n_group,
                             m.topk_group, m.norm_topk_prob, m.routed_scaling_factor)


class Experts(nn.Module):
    """E SwiGLU experts, gate and up fused: gate_up [E, 2I, D], down [E, D, I]. Over `tp`, this
    rank's contiguous run of E/N experts (`parallel.shard.expert_span`), which it sums alone."""

    def __init__(self, hidden: int, moe: MoEConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        world, rank = (tp.world, tp.rank) if tp is not None else (1, 0)
        self.first, E = expert_span(moe.num_experts, world, rank)
        self.sharded = E < moe.num_experts
        I = moe.intermediate_size
        self.gate_up = nn.Parameter(torch.empty(E, 2 * I, hidden))
        self.down = nn.Parameter(torch.empty(E, hidden, I))

    def forward(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """x [N, D], routing weights and expert ids [N, k] -> Σ_k w[n, k] · expert_idx[n, k](x[n]):
        [N, D], over this rank's experts (the others' pairs add nothing)."""
        w, idx = self.local(w, idx)
        if dispatch.moe_kernels(x):
            return self.grouped(x, w, idx)
        if gathers(x.shape[0], idx.shape[1], self.gate_up.shape[0]):
            return self.gathered(x, w, idx)
        if x.shape[0] >= SORTED_MIN_ROWS and not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            return self.sorted(x, w, idx)
        return self.all_experts(x, w, idx)

    def local(self, w: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pairs in this rank's expert ids 0..E-1, E (one past) for a pair routed to another
        rank's expert, whose weight becomes zero. Static shapes, no host sync: every pair stays,
        so the forms below keep their graph-captured shapes. Unsharded: as given."""
        if not self.sharded:
            return w, idx
        return local_pairs(w, idx, self.first, self.gate_up.shape[0])

    def grouped(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """The pairs sorted by expert on the device, each expert over its own pairs in grouped
        GEMMs (`dispatch.moe_experts`): static shapes, no read-back, each hit expert's weights
        read once per tile of its pairs. A pair of another rank's expert (id E) takes no slot in
        the layout: no tile computes it."""
        return dispatch.moe_experts(x, w, idx, self.gate_up, self.down, dropless=not self.sharded)

    def gathered(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Each (token, k) pair gathers its expert's weights and runs a batched GEMV (a pair of
        another rank's, id E, runs expert E - 1 at weight zero)."""
        if self.sharded:
            idx = idx.clamp(max=self.gate_up.shape[0] - 1)
        h = torch.matmul(self.gate_up[idx], x[:, None, :, None])[..., 0]       # [N, k, 2I]
        y = torch.matmul(self.down[idx], silu_mul(h)[..., None])[..., 0]       # [N, k, D]
        return (y * w[..., None].to(y.dtype)).sum(dim=1)

    def all_experts(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Every expert over every row, scaled by its combine weight (zero where it was not picked):
        E / k times the FLOPs of the picked experts alone, each expert's weights read once. Experts
        go in groups, each group three batched products (not a few kernels per expert: in a
        graphed verify the launches, not the FLOPs, were the cost); a group's intermediates hold
        at most ALL_EXPERTS_ELEMENTS values."""
        E = self.gate_up.shape[0]
        N = x.shape[0]
        combine = torch.zeros(N, E + 1, dtype=x.dtype, device=x.device)   # column E: other ranks' pairs
        combine = combine.scatter_add_(1, idx, w.to(x.dtype))[:, :E]
        out = torch.zeros_like(x)
        step = self.group(N)
        for a in range(0, E, step):
            gate_up, down = self.weights(a, min(a + step, E), x.dtype)
            h = torch.matmul(x, gate_up.transpose(1, 2))              # [e, N, 2I]
            y = torch.matmul(silu_mul(h), down.transpose(1, 2))     # [e, N, D]
            # the combine-weighted sum over the group's experts, one batched product per row
            out += torch.bmm(y.permute(1, 2, 0), combine[:, a:a + step, None])[..., 0]
        return out

    def sorted(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """The (token, k) pairs sorted by expert, each expert over its own rows only: the FLOPs of
        the picked experts, one host sync (the counts). The outputs go back to their pairs' places
        and are summed over k in order, so the result does not depend on atomic adds. Pairs of
        other ranks' experts (id E) sort last and stay zero."""
        N, k = idx.shape
        E = self.gate_up.shape[0]
        flat = idx.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=E + 1).tolist()[:E]
        mine = order[:sum(counts)]
        xs = x[mine // k]
        ys = torch.zeros(N * k, x.shape[1], dtype=x.dtype, device=x.device)
        start = 0
        for e, n in enumerate(counts):
            if n:
                ys[start:start + n] = self.expert(e, xs[start:start + n])
                start += n
        y = torch.empty_like(ys)
        y[order] = ys
        return (y.view(N, k, -1) * w[..., None].to(y.dtype)).sum(dim=1)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e (a local id) over the rows x [n, D] -> [n, D] (`sorted`)."""
        return F.linear(silu_mul(F.linear(x, self.gate_up[e])), self.down[e])

    def group(self, rows: int) -> int:
        """Experts per group of `all_experts`: their intermediates within ALL_EXPERTS_ELEMENTS."""
        _, two_i, D = self.gate_up.shape
        return max(1, ALL_EXPERTS_ELEMENTS // (rows * max(two_i, D)))

    def weights(self, a: int, b: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Experts a..b-1's gate_up [e, 2I, D] and down [e, D, I] (`all_experts`)."""
        return self.gate_up[a:b], self.down[a:b]


class SparseMoE(nn.Module):
    """The MoE block that replaces a layer's MLP: routed experts plus the shared ones. Over `tp`
    the router is whole, the routed experts this rank's E/N and the shared experts' rows its
    slice (column- then row-parallel, as a dense MLP's); one all-reduce sums both parts."""

    def __init__(self, hidden: int, moe: MoEConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.router = Router(hidden, moe)
        self.experts = Experts(hidden, moe, tp)
        self.shared = MLP(hidden, moe.num_shared * moe.intermediate_size, tp) if moe.num_shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])
        w, idx = self.router(h)
        out = self.experts(h, w, idx)
        if self.shared is not None:
            out = out + self.shared.partial(h)
        return all_reduce(out, self.tp).view(x.shape)
