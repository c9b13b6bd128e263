"""What one rank's forwards read and send, for `bench.rank`: the weights a forward reads (its
weight-read floor at a stated bandwidth), the routed experts it touches (from the routers' picks),
the collectives' time over the links from their message sizes, and the budget the cost model
picks from measured round costs and a stated acceptance curve."""
from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from drafttree.engine.budget import GREEDY, BudgetChooser
from drafttree.models import moe
from drafttree.phases import Phase, SpecConfig
from drafttree.runner.cost import CostTable

# NVIDIA's H200 SXM datasheet: HBM3e at 4.8 TB/s; NVLink 4 at 900 GB/s per GPU, both directions
# together, so 450 GB/s each way (the bus bandwidth a ring collective's traffic is divided by).
HBM_BANDWIDTH = 4.8e12
NVLINK_BANDWIDTH = 450e9
BANDWIDTH_SOURCE = ("NVIDIA H200 SXM datasheet: HBM3e 4.8 TB/s; NVLink 900 GB/s per GPU in both directions "
                    "together, 450 GB/s each way")
# Expected tokens a DDTree round commits (the bonus token included) at each budget: the shipped
# drafter's measured tau at budgets 8 and 32 (HumanEval, T = 0, drafter F:
# benchmarks/results/2026-12-04_h200_drafter_data.md), at 4 and 16 interpolated in log2(budget).
ACCEPTANCE = {4: 2.37, 8: 2.61, 16: 2.85, 32: 3.09}
ACCEPTANCE_SOURCE = ("the shipped drafter's (SmolLM2 pair) measured tau at budgets 8 and 32, HumanEval, T = 0 "
                     "(benchmarks/results/2026-12-04_h200_drafter_data.md, drafter F: 2.61, 3.09); 4 and 16 "
                     "interpolated in log2(budget); a stand-in: no Kimi K2 drafter has been measured")

Ops = list[tuple[str, tuple[int, ...], torch.dtype]]


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# -- the weights a forward reads --------------------------------------------------------------------

def held_bytes(*modules: nn.Module | None) -> int:
    """Bytes of the distinct tensors the modules hold (parameters, buffers, a drafter's fp8 copy of
    the head; not the modules a drafter borrows), the rotary tables left out: what loading them
    allocates."""
    seen, total = set(), 0
    for m in modules:
        if m is None:
            continue
        borrowed = (getattr(m, "embed", None), getattr(m, "lm_head", None))
        parts = [m, *(v for v in vars(m).values() if isinstance(v, nn.Module) and v not in borrowed)]
        for part in parts:
            for name, t in (*part.named_parameters(), *part.named_buffers()):
                if "rotary" in name or t.data_ptr() in seen:
                    continue
                seen.add(t.data_ptr())
                total += nbytes(t)
    return total


@dataclass(frozen=True)
class WeightReads:
    """A target's weights by how a forward reads them (on this rank)."""
    fixed: int             # every forward reads them whole: all but the routed experts and the embedding table
    embedding_row: int     # one embedding row (a forward reads one per token); 0 where the head ties the table
    expert: int            # one routed expert as stored (gate_up, down and any scales)
    experts_held: int      # routed experts held per sparse layer
    sparse_layers: int

    def forward_bytes(self, tokens: int, experts_touched: int) -> int:
        """Bytes of weights a forward of `tokens` tokens reads, its routed experts touching
        `experts_touched` distinct local experts over all layers together."""
        return self.fixed + tokens * self.embedding_row + experts_touched * self.expert


def weight_reads(model: nn.Module) -> WeightReads:
    """The rank's weights (parameters and stored experts' buffers; the rotary tables left out) by
    how a forward reads them."""
    experts = [m for m in model.modules() if isinstance(m, moe.Experts)]
    held = {id(t) for m in experts for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))}
    embed = model.embed_tokens.weight
    tied = model.lm_head.weight is embed
    fixed, seen = 0, set()
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        if "rotary" in name or id(t) in seen or id(t) in held:
            continue
        seen.add(id(t))
        if t is not embed or tied:
            fixed += nbytes(t)
    if not experts:
        return WeightReads(fixed, 0 if tied else nbytes(embed[0]), 0, 0, 0)
    ex = experts[0]
    E = ex.gate_up.shape[0]
    one = sum(nbytes(t) for t in (*ex.parameters(recurse=False), *ex.buffers(recurse=False))) // E
    return WeightReads(fixed, 0 if tied else nbytes(embed[0]), one, E, len(experts))


# -- the experts the routers pick ------------------------------------------------------------------

@contextlib.contextmanager
def router_picks(model: nn.Module) -> Iterator[dict[int, list[torch.Tensor]]]:
    """While on: the expert ids [tokens, k] every router of `model` picks, by layer, one entry per
    forward (read from the routers' outputs, so eager forwards only: a graph replay runs no hook)."""
    picks: dict[int, list[torch.Tensor]] = {}
    hooks = []
    for i, layer in enumerate(model.layers):
        if isinstance(layer.mlp, moe.SparseMoE):
            hooks.append(layer.mlp.router.register_forward_hook(
                lambda mod, inp, out, i=i: picks.setdefault(i, []).append(out[1].detach().flatten().cpu())))
    try:
        yield picks
    finally:
        for h in hooks:
            h.remove()


@dataclass(frozen=True)
class ExpertCount:
    """Distinct routed experts one forward touched per sparse layer: on this rank (its E/N), and
    over every rank's experts."""
    local: list[int]       # per sparse layer, in layer order
    every_rank: list[int]
    tokens: int
    top_k: int
    busiest_share: float   # share of the picks (all layers) on the busiest tenth of all experts: near 0.1
                           # under uniform routing once picks far outnumber experts, higher under skew

    @property
    def mean(self) -> float:
        return sum(self.local) / max(len(self.local), 1)

    @property
    def total_touched(self) -> int:
        """Local experts touched, all layers together (what the forward reads of them)."""
        return sum(self.local)

    def summary(self, num_experts: int, held: int) -> dict:
        """The counts, with what near-uniform routing would give: each token's k distinct picks of E
        leave an expert untouched with probability (1 - k/E)^tokens."""
        uniform = held * (1 - (1 - self.top_k / num_experts) ** self.tokens)
        return {"per_layer_mean": round(self.mean, 2), "per_layer_min": min(self.local, default=0),
                "per_layer_max": max(self.local, default=0), "held_per_layer": held,
                "uniform_expected": round(uniform, 2),
                "every_rank_per_layer_mean": round(sum(self.every_rank) / max(len(self.every_rank), 1), 2),
                "total_touched": self.total_touched, "tokens": self.tokens, "picks": self.tokens * self.top_k,
                "busiest_tenth_share": round(self.busiest_share, 3)}


def count_experts(model: nn.Module, picks: dict[int, list[torch.Tensor]]) -> ExpertCount:
    """The distinct experts of `picks` (one forward's, `router_picks`) on this rank and over all."""
    local, every, tokens = [], [], 0
    cfg = model.cfg.moe
    counts = torch.zeros(cfg.num_experts, dtype=torch.long)
    for i in sorted(picks):
        ids = torch.cat(picks[i])
        ex = model.layers[i].mlp.experts
        first, E = ex.first, ex.gate_up.shape[0]
        mine = ids[(ids >= first) & (ids < first + E)]
        local.append(int(mine.unique().numel()))
        every.append(int(ids.unique().numel()))
        tokens = ids.numel() // cfg.top_k
        counts += torch.bincount(ids, minlength=cfg.num_experts)
    top = counts.sort(descending=True).values[:max(1, cfg.num_experts // 10)]
    share = float(top.sum() / counts.sum()) if counts.sum() > 0 else 0.0
    return ExpertCount(local, every, tokens, cfg.top_k, share)


@contextlib.contextmanager
def skewed_routing(model: nn.Module, skew: float, spread: dict[int, float], seed: int = 0) -> Iterator[None]:
    """While on: every sparse layer's selection bias (DeepSeek's correction bias, which moves the
    picks only) gains skew * spread[layer] * z, z ~ N(0, 1) per expert (seeded), spread being the
    std over tokens of that layer's router scores: a routing that favours some experts, which random
    weights, routing near-uniformly, do not. A stated stand-in, not a model's routing."""
    g = torch.Generator().manual_seed(seed)
    saved = {}
    for i, layer in enumerate(model.layers):
        if isinstance(layer.mlp, moe.SparseMoE):
            router = layer.mlp.router
            if router.bias is None:
                raise ValueError("skewed routing moves the selection bias of sigmoid routers (DeepSeek-V3, Kimi K2); "
                                 "this model's routers have none (--skew 0)")
            z = torch.randn(router.bias.shape, generator=g)
            saved[i] = router.bias.detach().clone()
            with torch.no_grad():
                router.bias.add_((skew * spread.get(i, 0.0) * z).to(router.bias.device, router.bias.dtype))
    try:
        yield
    finally:
        with torch.no_grad():
            for i, b in saved.items():
                model.layers[i].mlp.router.bias.copy_(b)


@contextlib.contextmanager
def score_spread(model: nn.Module) -> Iterator[dict[int, float]]:
    """While on: per sparse layer, the std over tokens of its router's sigmoid scores (averaged over
    the experts), from its inputs in eager forwards (`skewed_routing` scales by it)."""
    out: dict[int, float] = {}
    hooks = []

    def hook(i: int):
        def run(mod, inp, _out) -> None:
            x = inp[0]
            if x.shape[0] > 1:
                s = torch.nn.functional.linear(x.float(), mod.weight.float()).sigmoid()
                out[i] = float(s.std(dim=0).mean())
        return run
    for i, layer in enumerate(model.layers):
        if isinstance(layer.mlp, moe.SparseMoE):
            hooks.append(layer.mlp.router.register_forward_hook(hook(i)))
    try:
        yield out
    finally:
        for h in hooks:
            h.remove()


# -- the collectives ----------------------------------------------------------------------------

def collectives(ops: Ops, world: int, bandwidth: float, latency_s: float = 0.0) -> dict:
    """The recorded collectives of a forward (`comm.recording`) and their time over the links: a
    ring all-reduce of S bytes sends and receives 2 (N - 1) / N * S on each rank, an all-gather
    (N - 1) times a rank's part; at `bandwidth` bytes/s each way, plus `latency_s` per collective."""
    kinds: dict[str, int] = {}
    shapes: dict[str, int] = {}
    message, link = 0, 0.0
    for op, shape, dtype in ops:
        size = dtype.itemsize
        for s in shape:
            size *= s
        kinds[op] = kinds.get(op, 0) + 1
        key = f"{op} {'x'.join(map(str, shape))} {str(dtype).removeprefix('torch.')}"
        shapes[key] = shapes.get(key, 0) + 1
        message += size
        link += 2 * (world - 1) / world * size if op == "all_reduce" else (world - 1) * size
    link_s = link / bandwidth
    return {"count": len(ops), "by_kind": kinds, "by_shape": shapes, "message_bytes": message,
            "link_bytes_per_rank": int(link), "link_ms": 1e3 * link_s, "latency_ms": 1e3 * latency_s * len(ops),
            "adds_ms": 1e3 * (link_s + latency_s * len(ops))}


# -- the budget the cost model picks ------------------------------------------------------------

def parse_acceptance(text: str) -> dict[int, float]:
    """'4:2.37,8:2.61' -> {4: 2.37, 8: 2.61}: expected tokens a round commits per budget (>= 1)."""
    out = {}
    for item in text.split(","):
        if not item.strip():
            continue
        try:
            b, tau = item.split(":")
            out[int(b)] = float(tau)
        except ValueError:
            raise ValueError(f"--acceptance {text!r}: expected budget:tokens pairs, e.g. 4:2.37,8:2.61") from None
    bad = {b: t for b, t in out.items() if b < 1 or t < 1}
    if bad or not out:
        raise ValueError(f"--acceptance {text!r}: budgets >= 1 with expected tokens >= 1 (the bonus token counts)")
    return out


def pick_budget(spec: SpecConfig, bucket: int, rows: int, budgets: list[int], seconds: dict[tuple[Phase, int], float],
                acceptance: dict[int, float]) -> dict:
    """The budget, 0 (a decode round) or one of `budgets`, with the most expected tokens per second
    as the engine's chooser prices them (`BudgetChooser`, `CostTable.round_seconds`): measured
    seconds per (phase, width) of this bucket, the acceptance curve as its calibrated prediction
    for greedy rows."""
    table = CostTable(spec)
    for (phase, width), s in seconds.items():
        table.seconds[(phase, bucket, width, False)] = s
    chooser = BudgetChooser(table, tuple(budgets))
    chooser.pooled[True].pred = [acceptance[b] for b in budgets]
    options = [0, *budgets]
    greedy = Counter({GREEDY: rows})
    rate = {b: chooser.expected_tokens(b, greedy) / chooser.round_seconds(bucket, b, False) for b in options}
    best = max(options, key=lambda b: (rate[b], -b))
    return {"picked": best, "tokens_per_s": {str(b): round(r, 1) for b, r in rate.items()},
            "round_ms": {str(b): round(1e3 * chooser.round_seconds(bucket, b, False), 4) for b in options}}
