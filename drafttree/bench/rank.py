"""One rank of a tensor-parallel group, measured on one device: its memory, its decode step against
its weight-read floor, and its DDTree rounds by budget.

Usage: python -m drafttree.bench.rank --random-weights kimi-k2:int4 --simulate-rank 0 --tensor-parallel-size 8
           [--num-layers N] [--batch 1,16] [--budgets 4,8,16,32] [--max-model-len N] [--prompt-len 512]
           [--gpu-memory-utilization 0.9] [--acceptance 4:2.37,8:2.61,16:2.85,32:3.09] [--profile 25] [--out rank.json]

The rank is built as rank r of N builds itself (`random_model` over a group: its attention heads
and MLP rows, the E/N routed experts expert parallelism gives it, MLA's latent path and the router
whole; random weights drawn in the stored form the shape names, `kimi-k2:int4`'s routed experts as
Kimi K2.6 ships them; or a checkpoint's shards with --model), under a simulated group
(`TPGroup.simulated_rank`: no process group). Every collective of the model is then a local
operation on the same bytes (`parallel.comm`): an all-reduce multiplies its tensor by 1 in place
(one read and one write of it), an all-gather writes the gathered tensor, N times this rank's part,
from that part; the hosts' agreements are the identity. So the times are the rank's own compute
and memory; what the links add is estimated from the collectives' recorded message sizes at a
stated NVLink bandwidth (and, if given, a latency per collective).

Reported (a table; JSON with --out):
- memory: bytes allocated by the weights, by the KV pool and at peak (on the CPU the tensors' bytes),
  against the memory plan's for the same config (`engine.memory_plan`);
- the decode step (a CUDA graph; eager on the CPU) against the rank's weight-read floor: the bytes of
  the weights it reads (every weight but the routed experts and the embedding table whole, one
  embedding row per token, and each routed expert it touches as stored: int4 words and scales) over
  --hbm-bandwidth;
- at each batch and budget, the DDTree round (draft + verify, the draft building the tree at the
  largest budget as the engine does) in decode steps, and the distinct routed experts the verify
  touched per layer on this rank, counted from the routers' picks in an eager forward of the same
  rows (random weights route near-uniformly; --skew also times and counts them under a stated
  skewed routing);
- the collectives of a decode step and of a round, and what they add at the stated bandwidth;
- the budget the cost model picks (`engine.budget`'s pricing) from the measured costs and an
  acceptance curve (--acceptance: expected tokens per round by budget).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from drafttree.bench import rank_costs
from drafttree.bench.environment import environment
from drafttree.config import resolve_device
from drafttree.engine.cli_args import add_engine_args, config_from_args
from drafttree.engine.config import EngineConfig
from drafttree.engine.memory_plan import ASSUMED_DEVICE, GiB, Device, MemoryPlan, plan_for_setup
from drafttree.engine.plan import EngineSetup, load_models, resolve, target_config
from drafttree.engine.pool_sizing import size_pool
from drafttree.parallel import comm
from drafttree.parallel.group import TPGroup
from drafttree.parallel.shard import check_size
from drafttree.phases import Phase, auto_budgets
from drafttree.runner.model_runner import CacheConfig, ModelRunner
from drafttree.runner.phase_table import PhaseStep, bucket_steps
from drafttree.runner.timing import median_seconds
from drafttree.sampling import SampleMode, SamplingParams
from drafttree.settings import current, scope

log = logging.getLogger(__name__)
GREEDY = SampleMode.GREEDY
LOCAL_OPS = {"all_reduce": "x.mul_(1) in place: one read and one write of the tensor (its values stay this "
                           "rank's partial sum)",
             "all_gather": "the gathered output (N times this rank's part) written by one copy of this rank's "
                           "part into every rank's slot",
             "host_agreements": "the identity: this rank's value stands for every rank's"}


@dataclass(frozen=True)
class Options:
    rank: int
    batches: tuple[int, ...]
    budgets: tuple[int, ...]
    prompt_len: int
    iters: int
    hbm_bandwidth: float
    nvlink_bandwidth: float
    latency_s: float
    acceptance: dict[int, float]
    skew: float
    profile: int = 0      # kernels listed from a profile of the decode step (0: no profile)


@dataclass
class Rank:
    setup: EngineSetup
    runner: ModelRunner
    plan: MemoryPlan
    memory: dict
    base: int          # bytes allocated on the device before the rank was built (CUDA)


def _allocated(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def build(cfg: EngineConfig, o: Options) -> Rank:
    """Rank o.rank of cfg.tensor_parallel_size on one device, its KV pool sized as an engine's."""
    world = cfg.tensor_parallel_size
    if not 0 <= o.rank < world:
        raise ValueError(f"--simulate-rank {o.rank}: a rank of 0..{world - 1} (--tensor-parallel-size {world})")
    check_size(target_config(cfg), world)
    device = resolve_device(cfg.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    tp = TPGroup.simulated_rank(o.rank, world, device) if world > 1 else None
    setup = resolve(cfg, tp)
    setup = dataclasses.replace(setup, spec=dataclasses.replace(setup.spec, budget=max(o.budgets)))
    cuda = device.type == "cuda"
    plan = plan_for_setup(setup, Device.of(cuda_total=torch.cuda.mem_get_info(device)[1]) if cuda else ASSUMED_DEVICE)
    if not plan.weights_fit():
        raise ValueError(plan.format())
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    base = _allocated(device)
    target, drafter = load_models(setup, tp)
    after_load = _allocated(device)
    size = size_pool(setup, tp)
    cache = CacheConfig(cfg.max_num_seqs, size.max_model_len, setup.spec.kv_headroom, cfg.page_size, size.num_pages)
    runner = ModelRunner(target, drafter, setup.spec, cache, device, setup.dtype)
    after_kv = _allocated(device)
    pools = [t for kv in (runner.kv, runner.dkv) if kv is not None for t in (kv.k, kv.v)]
    share = next(r for r in plan.ranks if o.rank in r.ranks)
    weights, pool = rank_costs.held_bytes(target, drafter), sum(rank_costs.nbytes(t) for t in pools)
    measured = {"weights": after_load - base if cuda else weights, "weights_held": weights, "kv_pool": pool,
                "after_kv": after_kv - base if cuda else weights + pool, "pool_pages": size.num_pages,
                "source": "torch.cuda.memory_allocated, less what was allocated before" if cuda else
                "the bytes of the tensors held (no device allocator on the CPU)"}
    planned = {"weights": share.weight_bytes, "by_kind": share.weights, "kv_pool": plan.pool_bytes(share),
               "pool_pages": plan.pool_pages, "kv_budget": share.kv_budget, "kv_tokens": plan.kv_tokens,
               "kv_bytes_per_token": share.kv_bytes_per_token, "graphs_estimate": plan.graph_bytes,
               "context_allowance": plan.context_bytes, "device_bytes": plan.device.total_bytes,
               "after_kv": share.weight_bytes + plan.pool_bytes(share)}
    ratio = {k: measured[k] / planned[k] for k in ("weights", "kv_pool", "after_kv") if planned[k]}
    memory = {"measured": measured, "plan": planned, "measured_over_plan": ratio,
              "within_5_percent": all(abs(r - 1) <= 0.05 for r in ratio.values()), "plan_table": plan.format()}
    return Rank(setup, runner, plan, memory, base)


@torch.inference_mode()
def run(cfg: EngineConfig, o: Options) -> dict:
    """Build the rank and measure it; the results as a dict (`format_report` prints it)."""
    t0 = time.perf_counter()
    rank = build(cfg, o)
    setup, r = rank.setup, rank.runner
    built_s = time.perf_counter() - t0
    m = rank.memory["measured"]
    log.info("built rank %d of %d in %.1f s: weights %s, KV pool %s (%d pages)", o.rank, setup.world, built_s,
             _size(m["weights"]), _size(m["kv_pool"]), m["pool_pages"])
    with scope(setup.settings):
        batches, kv_len, graphed = measure(rank, o)
    dev = r.device
    if dev.type == "cuda":
        rank.memory["measured"]["peak"] = torch.cuda.max_memory_allocated(dev) - rank.base
    world = setup.world
    spec = setup.spec
    reads = rank_costs.weight_reads(r.target)
    return {"model": cfg.random_weights or cfg.model, "rank": o.rank, "tensor_parallel_size": world,
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "dtype": str(setup.dtype).removeprefix("torch."), "graphed": graphed, "prompt_len": o.prompt_len,
            "kv_len": kv_len, "max_model_len": r.cache_cfg.max_model_len, "max_num_seqs": r.cache_cfg.max_num_seqs,
            "page_size": r.cache_cfg.page_size, "iters": o.iters,
            "spec": {"method": spec.method, "block_size": spec.block_size, "budgets": list(o.budgets),
                     "draft_budget": spec.budget},
            "collectives_as_local_ops": LOCAL_OPS,
            "bandwidths": {"hbm": o.hbm_bandwidth, "nvlink": o.nvlink_bandwidth,
                           "collective_latency_us": 1e6 * o.latency_s, "source": rank_costs.BANDWIDTH_SOURCE},
            "acceptance": {"tokens_per_round": {str(b): t for b, t in sorted(o.acceptance.items())},
                           "source": (rank_costs.ACCEPTANCE_SOURCE if o.acceptance == rank_costs.ACCEPTANCE
                                      else "--acceptance")},
            "routing": routing_note(cfg, o),
            "weights_read": dataclasses.asdict(reads), "memory": rank.memory, "batches": batches,
            "seconds": {"build": round(built_s, 2), "measure": round(time.perf_counter() - t0 - built_s, 2)},
            "environment": environment()}


def routing_note(cfg: EngineConfig, o: Options) -> str:
    text = ("random weights: routers and hidden states are random, so the picks are near uniform (compare "
            "uniform_expected)" if cfg.random_weights else "the checkpoint's routers, over random prompts")
    if o.skew:
        text += (f"; skewed: each layer's selection bias gains {o.skew} x the spread of its router scores over "
                 "tokens x N(0, 1) per expert (a stand-in, not a model's routing)")
    return text


def measure(rank: Rank, o: Options) -> tuple[list[dict], int, bool]:
    """Prefill rows of random prompts, capture the round's graphs (CUDA), and measure each batch."""
    r = rank.runner
    V = r.target.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    rows = max(o.batches)
    r.prefill_rows([torch.randint(0, V - 2, (o.prompt_len,), generator=g).tolist() for _ in range(rows)],
                   [SamplingParams(temperature=0.0)] * rows, list(range(rows)))
    kv_len = r.round_kv_len(o.prompt_len)
    graphed = r.device.type == "cuda"
    if graphed:
        t0 = time.perf_counter()
        r.capture((GREEDY,), batch_sizes=sorted({r.cache_cfg.batch_bucket(B) for B in o.batches}),
                  kv_lengths=[kv_len])
        log.info("captured the round's graphs in %.1f s", time.perf_counter() - t0)
    prefilled = r.state.snapshot()
    out = []
    for B in o.batches:
        t0 = time.perf_counter()
        out.append(Batch(rank, o, B, kv_len, prefilled).measure())
        log.info("batch %d measured in %.1f s", B, time.perf_counter() - t0)
    return out, kv_len, graphed


class Batch:
    """One batch's measurements: rows 0..B-1 prefilled, a draft made (every timed run starts from
    that state), its steps from the phase table."""

    def __init__(self, rank: Rank, o: Options, B: int, kv_len: int, prefilled: list[torch.Tensor]) -> None:
        r = rank.runner
        self.rank, self.o, self.B, self.kv_len, self.r = rank, o, B, kv_len, r
        self.bucket = r.cache_cfg.batch_bucket(B)
        self.target, self.world, self.spec = r.target, rank.setup.world, rank.setup.spec
        r.state.restore(prefilled)
        r.state.park(B, self.bucket)
        steps = {(st.phase, st.budget): st
                 for st in bucket_steps(self.spec, self.bucket, GREEDY, r.drafter is not None)}
        self.draft, self.decode = steps[(Phase.DRAFT, 0)], steps[(Phase.DECODE, 0)]
        self.context = steps.get((Phase.CONTEXT, 0))
        self.verify = {b: steps[(Phase.VERIFY, b)] for b in o.budgets}
        with comm.recording() as ops:
            self.draft.run(r.round_ctx, self.bucket, kv_len, GREEDY)
        self.draft_ops = list(ops)
        self.drafted = r.state.snapshot()
        self.reads = rank_costs.weight_reads(self.target)
        moe_cfg = self.target.cfg.moe
        self.num_experts = moe_cfg.num_experts if moe_cfg is not None else 0

    def reset(self) -> None:
        self.r.state.restore(self.drafted)

    def forward(self, st: PhaseStep) -> tuple[rank_costs.Ops, rank_costs.ExpertCount | None]:
        """One eager forward of the step from the drafted state: its collectives and the experts
        its routers picked."""
        self.reset()
        with comm.recording() as ops, rank_costs.router_picks(self.target) as picks:
            st.run(self.r.round_ctx, self.bucket, self.kv_len, GREEDY)
        return list(ops), (rank_costs.count_experts(self.target, picks) if picks else None)

    def runner_of(self, st: PhaseStep) -> tuple[Callable[[], object], bool]:
        """(a call that runs the step: its graph's replay where captured, else eagerly; graphed)."""
        r = self.r
        graph = r.graphs.get(st, self.bucket, GREEDY, self.kv_len) if r.graphs is not None else None
        if graph is not None:
            return graph.replay, True
        return (lambda: st.run(r.round_ctx, self.bucket, self.kv_len, GREEDY)), False

    def ms(self, *steps: PhaseStep) -> float:
        """Median milliseconds of the steps run in turn (their graphs on CUDA, else eagerly)."""
        fns = [self.runner_of(st)[0] for st in steps]
        return 1e3 * median_seconds(lambda: [f() for f in fns], self.reset, self.r.device, self.o.iters, warmups=2)

    def floor_ms(self, tokens: int, count: rank_costs.ExpertCount | None) -> float:
        return 1e3 * self.read_bytes(tokens, count) / self.o.hbm_bandwidth

    def read_bytes(self, tokens: int, count: rank_costs.ExpertCount | None) -> int:
        return self.reads.forward_bytes(tokens, count.total_touched if count is not None else 0)

    def experts(self, count: rank_costs.ExpertCount | None) -> dict | None:
        return count.summary(self.num_experts, self.reads.experts_held) if count is not None else None

    def links(self, ops: rank_costs.Ops) -> dict:
        return rank_costs.collectives(ops, self.world, self.o.nvlink_bandwidth, self.o.latency_s)

    def measure(self) -> dict:
        o, bucket, spec = self.o, self.bucket, self.spec
        dec_ops, dec_count = self.forward(self.decode)
        ctx_ops = self.forward(self.context)[0] if self.context is not None else []
        with rank_costs.score_spread(self.target) as spread:
            ver = {b: self.forward(self.verify[b]) for b in o.budgets}
        dec_ms, draft_ms = self.ms(self.decode), self.ms(self.draft)
        ctx_ms = self.ms(self.context) if self.context is not None else 0.0
        dec_links, draft_links = self.links(dec_ops), self.links(self.draft_ops)
        dec_floor = self.floor_ms(bucket, dec_count)
        # the draft reads the drafter whole and the borrowed LM head's rows
        drafted = rank_costs.held_bytes(self.r.drafter) + rank_costs.nbytes(self.target.lm_head.weight)
        draft_floor = 1e3 * drafted / o.hbm_bandwidth
        out = {"batch": self.B, "bucket": bucket,
               "decode": {"ms": dec_ms, "weight_floor_ms": dec_floor, "over_floor": dec_ms / dec_floor,
                          "weights_read_bytes": self.read_bytes(bucket, dec_count), "experts": self.experts(dec_count),
                          "kv_read_bytes": bucket * self.kv_len * self.target.kv_layout.bytes_per_token(self.r.dtype),
                          "collectives": dec_links, "with_collectives_ms": dec_ms + dec_links["adds_ms"]},
               "context_ms": ctx_ms, "context_collectives": len(ctx_ops),
               "draft_ms": draft_ms, "draft_floor_ms": draft_floor, "draft_collectives": draft_links, "budgets": {}}
        seconds = {(Phase.DECODE, 1): dec_ms / 1e3, (Phase.DRAFT, spec.block_size): draft_ms / 1e3}
        links = {(Phase.DECODE, 1): dec_links["adds_ms"] / 1e3,
                 (Phase.DRAFT, spec.block_size): draft_links["adds_ms"] / 1e3}
        if self.context is not None:
            seconds[(Phase.CONTEXT, self.context.width)] = ctx_ms / 1e3
            links[(Phase.CONTEXT, self.context.width)] = self.links(ctx_ops)["adds_ms"] / 1e3
        for b in o.budgets:
            ops, count = ver[b]
            v_ms, round_ms = self.ms(self.verify[b]), self.ms(self.draft, self.verify[b])
            v_links = self.links(ops)
            seconds[(Phase.VERIFY, b + 1)], links[(Phase.VERIFY, b + 1)] = v_ms / 1e3, v_links["adds_ms"] / 1e3
            v_floor = self.floor_ms(bucket * (b + 1), count)
            added = v_links["adds_ms"] + draft_links["adds_ms"]
            out["budgets"][str(b)] = {
                "verify_ms": v_ms, "round_ms": round_ms, "round_in_decode_steps": round_ms / dec_ms,
                "experts": self.experts(count), "verify_weight_floor_ms": v_floor,
                "round_floor_in_decode_floors": (v_floor + draft_floor) / dec_floor, "verify_collectives": v_links,
                "round_with_collectives_in_decode_steps": (round_ms + added) / (dec_ms + dec_links["adds_ms"])}
        out["choice"] = rank_costs.pick_budget(spec, bucket, self.B, list(o.budgets), seconds, o.acceptance)
        linked = {k: s + links[k] for k, s in seconds.items()}
        out["choice_with_collectives"] = rank_costs.pick_budget(spec, bucket, self.B, list(o.budgets), linked,
                                                                o.acceptance)
        if o.skew and spread:   # no routed layer kept (--num-layers within the dense ones): nothing to skew
            out["skewed"] = self.skewed(spread)
        if o.profile:
            k = out["decode"]["kernels"] = self.kernels(self.decode, o.profile)
            # what the kernels' own time leaves of the step: launches and the gaps between kernels
            k["per_layer"] = k["count_per_step"] / self.target.cfg.num_layers
            k["share_of_step"] = k["us_per_step"] / 1e3 / dec_ms
        return out

    def kernels(self, st: PhaseStep, top: int) -> dict:
        """The device kernels of one step (its graph's replay where captured), by name: how many
        run per step and their time per step, the `top` longest; from `torch.profiler`, whose
        timings of back-to-back kernels leave out the gaps between them."""
        from torch.profiler import ProfilerActivity, profile
        r, reps = self.r, 5
        run, graphed = self.runner_of(st)
        cuda = r.device.type == "cuda"
        self.reset()
        run()
        activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
        with profile(activities=[activity]) as prof:
            for _ in range(reps):
                self.reset()
                run()
            if cuda:
                torch.cuda.synchronize(r.device)
        rows = []
        for ev in prof.key_averages():
            us = (ev.device_time_total if cuda else ev.self_cpu_time_total) / reps
            if us > 0 and (not cuda or ev.device_type == torch.autograd.DeviceType.CUDA):
                rows.append({"name": ev.key, "per_step": ev.count / reps, "us": us})
        rows.sort(key=lambda k: -k["us"])
        return {"source": "torch.profiler over %d %s, the state reset before each (its copies included)"
                % (reps, "graph replays" if graphed else "eager runs"),
                "count_per_step": sum(k["per_step"] for k in rows), "us_per_step": sum(k["us"] for k in rows),
                "top": rows[:top]}

    def skewed(self, spread: dict[int, float]) -> dict:
        """The decode step and each round again under a skewed routing (`rank_costs.skewed_routing`)."""
        out: dict = {"skew": self.o.skew, "budgets": {}}
        with rank_costs.skewed_routing(self.target, self.o.skew, spread):
            count = self.forward(self.decode)[1]
            dec_ms = self.ms(self.decode)
            out["decode"] = {"ms": dec_ms, "experts": self.experts(count)}
            for b in self.o.budgets:
                count = self.forward(self.verify[b])[1]
                round_ms = self.ms(self.draft, self.verify[b])
                out["budgets"][str(b)] = {"round_ms": round_ms, "round_in_decode_steps": round_ms / dec_ms,
                                          "experts": self.experts(count)}
        return out


# -- the report -------------------------------------------------------------------------------------

def _size(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB / 10 else f"{n / 2**20:.2f} MiB"


def format_report(res: dict) -> str:
    mem = res["memory"]
    m, p = mem["measured"], mem["plan"]
    lines = [f"rank {res['rank']} of {res['tensor_parallel_size']}: {res['model']}, {res['dtype']}, {res['device']} "
             f"({'CUDA graphs' if res['graphed'] else 'eager'}); collectives run as local operations",
             f"memory ({m['source']}):",
             f"  {'':<20}{'measured':>14}{'plan':>14}{'measured/plan':>15}",
             *(f"  {label:<20}{_size(m[k]):>14}{_size(p[k]):>14}{m[k] / p[k]:>15.3f}"
               for label, k in (("weights", "weights"), ("KV pool", "kv_pool"), ("weights + KV pool", "after_kv"))
               if p[k]),
             f"  KV tokens the plan gives per GPU: {p['kv_tokens']:,} ({p['kv_bytes_per_token']:,} bytes per token)"
             + (f"; peak allocated {_size(m['peak'])}" if "peak" in m else "")]
    for b in res["batches"]:
        d = b["decode"]
        ex = d["experts"]
        lines.append(f"batch {b['batch']} (bucket {b['bucket']}), attention over {res['kv_len']} slots: decode "
                     f"{d['ms']:.3f} ms, weight-read floor {d['weight_floor_ms']:.3f} ms ({d['over_floor']:.2f}x; "
                     f"{d['weights_read_bytes'] / 1e9:.2f} GB"
                     + (f", {ex['per_layer_mean']:.2f} of {ex['held_per_layer']} experts a layer" if ex else "")
                     + f"); collectives {d['collectives']['count']}, +{d['collectives']['adds_ms']:.3f} ms")
        lines.append(f"  {'budget':>6} {'verify ms':>10} {'round ms':>10} {'round/decode':>13} {'+links':>8} "
                     f"{'experts/layer':>14} {'uniform':>8} {'floor/decode floor':>19}")
        for n, v in b["budgets"].items():
            e = v["experts"] or {}
            lines.append(f"  {n:>6} {v['verify_ms']:>10.3f} {v['round_ms']:>10.3f} {v['round_in_decode_steps']:>13.2f} "
                         f"{v['round_with_collectives_in_decode_steps']:>8.2f} {e.get('per_layer_mean', 0):>14.2f} "
                         f"{e.get('uniform_expected', 0):>8.2f} {v['round_floor_in_decode_floors']:>19.2f}")
        if "kernels" in d:
            k = d["kernels"]
            lines.append(f"  decode kernels: {k['count_per_step']:.0f} a step ({k['per_layer']:.1f} a layer), "
                         f"{k['us_per_step'] / 1e3:.3f} ms of kernel time, {100 * k['share_of_step']:.0f} % of the "
                         f"step ({k['source']}); the longest:")
            lines += [f"    {x['us']:9.1f} us {x['per_step']:6.1f}x  {x['name'][:100]}" for x in k["top"]]
        c, cl = b["choice"], b["choice_with_collectives"]
        lines.append(f"  the cost model picks {c['picked']} (expected tokens/s: "
                     + ", ".join(f"{k}: {x}" for k, x in c["tokens_per_s"].items())
                     + f"); with the collectives' estimate, {cl['picked']}")
        if "skewed" in b:
            s = b["skewed"]
            lines.append(f"  skewed routing (skew {s['skew']}): decode {s['decode']['ms']:.3f} ms; rounds in decode "
                         "steps " + ", ".join(f"{n}: {v['round_in_decode_steps']:.2f} "
                                              f"({v['experts']['per_layer_mean']:.1f} experts/layer; the busiest "
                                              f"tenth of experts took {v['experts']['busiest_tenth_share']:.2f} "
                                              f"of the picks, {v['experts']['picks']} a layer)"
                                              for n, v in s["budgets"].items()))
    return "\n".join(lines)


# -- the command ------------------------------------------------------------------------------------

ENGINE_FIELDS = ("model", "draft_model", "random_weights", "random_drafter", "block_size", "dtype",
                 "draft_quantization", "device", "max_model_len", "kv_cache_memory_gb", "gpu_memory_utilization",
                 "page_size", "tensor_parallel_size")


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected comma-separated integers") from None
    if not out or min(out) < 1:
        raise ValueError(f"{flag} {text!r}: expected integers >= 1")
    return tuple(sorted(set(out)))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m drafttree.bench.rank", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p.add_argument_group("engine"), ENGINE_FIELDS,
                    notes={"gpu_memory_utilization": "here 0.9 on CUDA unless --kv-cache-memory-gb is given"})
    p.add_argument("--simulate-rank", type=int, default=0, metavar="R", help="the rank built and measured (default 0)")
    p.add_argument("--num-layers", type=int, default=None, help="with --random-weights: keep the first N layers")
    p.add_argument("--batch", default="1,16", help="batch sizes measured, comma-separated (default 1,16); the "
                                                   "engine's rows (max_num_seqs) are the largest")
    p.add_argument("--budgets", default="4,8,16,32", help="DDTree budgets timed, comma-separated (default 4,8,16,32): "
                                                          "those `auto` chooses among up to the largest")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens of each row before the rounds")
    p.add_argument("--iters", type=int, default=20, help="timed runs of each step (the median is reported)")
    p.add_argument("--hbm-bandwidth", type=float, default=rank_costs.HBM_BANDWIDTH,
                   help="bytes/s of the weight-read floor (default 4.8e12: an H200's HBM3e)")
    p.add_argument("--nvlink-bandwidth", type=float, default=rank_costs.NVLINK_BANDWIDTH,
                   help="bytes/s each way a rank's collectives move over NVLink (default 450e9: an H200's 900 GB/s "
                        "NVLink, both directions together)")
    p.add_argument("--collective-latency-us", type=float, default=0.0,
                   help="microseconds each collective adds beside its bytes (default 0: bytes alone)")
    p.add_argument("--acceptance", default=",".join(f"{b}:{t}" for b, t in rank_costs.ACCEPTANCE.items()),
                   help="expected tokens a round commits by budget, budget:tokens,... (default: the shipped "
                        "drafter's measured tau at 8 and 32, 4 and 16 interpolated; see the output's source)")
    p.add_argument("--skew", type=float, default=None,
                   help="also measure under a skewed routing: the selection bias gains SKEW x the router scores' "
                        "spread x N(0, 1) per expert (sigmoid routers: DeepSeek-V3, Kimi K2; default 1 for them, "
                        "0 (off) for other models)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also profile the decode step (torch.profiler) and list its N longest kernels by name")
    p.add_argument("--out", default=None, help="also write the results (JSON) to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg, o = config_of(a)
        res = run(cfg, o)
    except ValueError as e:
        p.error(str(e))
    print(format_report(res))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


def config_of(a: argparse.Namespace) -> tuple[EngineConfig, Options]:
    """The engine config and the options of parsed flags; every bad value refused here."""
    if a.num_layers is not None:
        if not a.random_weights:
            raise ValueError("--num-layers needs --random-weights")
        a.random_weights = f"{a.random_weights}@{a.num_layers}"
    batches, budgets = _ints(a.batch, "--batch"), _ints(a.budgets, "--budgets")
    allowed = auto_budgets(max(budgets))
    if not set(budgets) <= set(allowed):
        raise ValueError(f"--budgets {a.budgets}: the budgets `auto` chooses among up to {max(budgets)} are "
                         f"{list(allowed)} (powers of two from 4, and the largest)")
    acceptance = rank_costs.parse_acceptance(a.acceptance)
    missing = [b for b in budgets if b not in acceptance]
    if missing:
        raise ValueError(f"--acceptance gives no expected tokens for budgets {missing}")
    if a.profile < 0:
        raise ValueError(f"--profile must be >= 0, got {a.profile}")
    for flag, v in (("--prompt-len", a.prompt_len), ("--iters", a.iters)):
        if v < 1:
            raise ValueError(f"{flag} must be >= 1, got {v}")
    for flag, v in (("--hbm-bandwidth", a.hbm_bandwidth), ("--nvlink-bandwidth", a.nvlink_bandwidth)):
        if not v > 0:
            raise ValueError(f"{flag} must be > 0, got {v}")
    if a.collective_latency_us < 0 or (a.skew is not None and a.skew < 0):
        raise ValueError("--collective-latency-us and --skew must be >= 0")
    cuda = resolve_device(a.device).type == "cuda"
    if cuda and a.gpu_memory_utilization is None and a.kv_cache_memory_gb is None:
        a.gpu_memory_utilization = 0.9   # the memory plan's figure for a deployment
    cfg = config_from_args(a, spec="ddtree", budget="auto", max_num_seqs=max(batches), cuda_graphs=cuda,
                           prefill_graphs=False, sampler_modes=("greedy", "sample"))
    if current().deterministic and cfg.tensor_parallel_size > 2:
        raise ValueError("deterministic mode (DRAFTTREE_DETERMINISTIC) orders an all-reduce's addends over the "
                         "ranks, which a simulated rank does not have")
    moe = target_config(cfg).moe
    biased = moe is not None and moe.scoring == "sigmoid"
    skew = a.skew if a.skew is not None else float(biased)
    if skew and not biased:
        raise ValueError("--skew moves the selection bias of sigmoid routers (DeepSeek-V3, Kimi K2); this model's "
                         "routers have none: give --skew 0")
    o = Options(a.simulate_rank, batches, budgets, a.prompt_len, a.iters, a.hbm_bandwidth, a.nvlink_bandwidth,
                a.collective_latency_us / 1e6, acceptance, skew, a.profile)
    return cfg, o


if __name__ == "__main__":
    raise SystemExit(main())
