"""Per-phase latency of one round: eager (each piece timed alone) and graphed (each phase graph).

Usage: python -m drafttree.bench.phases [--random-weights qwen3-8b] [--spec ddtree --budget 32]
       [--block-size 16] [--batch 1] [--prompt-len 512] [--tensor-parallel-size N] [--out results.json]
       python -m drafttree.bench.phases --random-weights kimi-k2 --num-layers 4   # a large model's first layers
Decode-step time is measured on the same target, so a round can be put in decode-step units.

With --tensor-parallel-size N every rank (spawned here, one GPU each, or torchrun's: `torchrun
--nproc-per-node N -m drafttree.bench.phases ... --tensor-parallel-size N`) runs this same code on its
shards, and rank 0 reports. The collectives of one decode step (recorded as it runs) are also
timed alone, as a graph of just them: `collectives_share` is their time over the step's.
"""
from __future__ import annotations

import argparse
import json
from typing import Callable

import torch

from drafttree.bench.environment import environment
from drafttree.engine.cli_args import add_engine_args, config_from_args
from drafttree.engine.engine import Engine, EngineConfig
from drafttree.engine.launch import check_launch, run_ranks
from drafttree.parallel import comm
from drafttree.parallel.group import TPGroup
from drafttree.phases import Phase
from drafttree.runner.capture import capture_graph
from drafttree.runner.phase_table import bucket_steps, round_steps
from drafttree.runner.timing import median_seconds
from drafttree.sampling import SampleMode, SamplingParams
from drafttree.settings import scope
from drafttree.spec_decode import rounds
from drafttree.spec_decode.tree import build_tree


def timed(fn: Callable[[], object], reset: Callable[[], None], device: torch.device, iters: int) -> float:
    """Median milliseconds of fn() over `iters` runs, state reset before each (reset not timed)."""
    return 1e3 * median_seconds(fn, reset, device, iters, warmups=3)


@torch.inference_mode()
def bench(cfg: EngineConfig, batch: int, prompt_len: int, iters: int, budgets_tree: list[int],
          tp: TPGroup | None = None) -> dict:
    """The timings, on this rank (every rank of `tp` runs this same code, in the same order)."""
    eng = Engine(cfg, tp)
    with scope(eng.settings):   # the phases are called here, not through the engine's own entry points
        return _timings(eng, batch, prompt_len, iters, budgets_tree, tp)


def _timings(eng: Engine, batch: int, prompt_len: int, iters: int, budgets_tree: list[int],
             tp: TPGroup | None) -> dict:
    r, dev, spec = eng.runner, eng.device, eng.spec
    rc = r.round_ctx   # what the round functions take
    V = r.target.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    r.prefill_rows([torch.randint(0, V - 2, (prompt_len,), generator=g).tolist() for _ in range(batch)],
                   [SamplingParams(temperature=0.0)] * batch, list(range(batch)))
    B, kv_len = batch, r.round_kv_len(prompt_len)   # the attention length the engine's rounds use
    greedy = SampleMode.GREEDY
    steps = bucket_steps(spec, B, greedy, r.drafter is not None)
    by_phase = {st.phase: st for st in steps if st.phase is not Phase.VERIFY or st.budget == spec.budget_at(B)}
    if Phase.DRAFT in by_phase:   # the prefilled rows with a drafted tree: what every timed run starts from
        by_phase[Phase.DRAFT].run(rc, B, kv_len, greedy)
    snap = r.state.snapshot()

    def reset() -> None:
        r.state.restore(snap)

    res: dict = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                 "spec": spec.method, "block_size": spec.block_size, "budget": spec.budget, "batch": B,
                 "prompt_len": prompt_len, "dtype": str(eng.dtype), "kv_len": kv_len,
                 "tensor_parallel_size": eng.world,
                 "widths": {st.phase.value: st.width for st in by_phase.values()}, "environment": environment(),
                 "eager_ms": {}, "graph_ms": {}}
    ms = res["eager_ms"]
    for phase, st in by_phase.items():   # each step of the phase table, eagerly
        ms[phase.value] = timed(lambda st=st: st.run(rc, B, kv_len, greedy), reset, dev, iters)
    reset()
    with comm.recording() as ops:   # the decode step's collectives, to time them alone
        by_phase[Phase.DECODE].run(rc, B, kv_len, greedy)
    res["decode_collectives"] = _count(ops)
    collectives = comm.replay(ops, tp, dev) if ops else None
    if collectives is not None:
        ms["decode_collectives"] = timed(collectives, lambda: None, dev, iters)
        ms["collectives_share"] = ms["decode_collectives"] / ms["decode"]
    if spec.speculative:   # the draft and verify phases in their pieces
        box: dict = {}
        ms["draft_forward"] = timed(lambda: box.update(l=rounds.draft(rc, B, kv_len)), reset, dev, iters)
        ms["tree_build"] = timed(lambda: box.update(t=rounds.make_tree(rc, box["l"], B)), reset, dev, iters)
        ms["verify_forward"] = timed(lambda: box.update(v=rounds.verify_forward(rc, B, kv_len, box["t"], greedy)),
                                     reset, dev, iters)
        ms["accept_commit"] = timed(lambda: rounds.accept_commit(rc, B, box["t"], *box["v"][:2]), reset, dev, iters)
        ms["round"] = timed(lambda: rounds.spec_round(rc, B, kv_len, greedy), reset, dev, iters)
        ms["round_in_decode_steps"] = ms["round"] / ms["decode"]
    if dev.type == "cuda":
        gm = res["graph_ms"]
        r.capture((greedy,), batch_sizes=[B], kv_lengths=[kv_len])
        reset()
        graphs = {phase: r.graphs.get(st, B, greedy, kv_len) for phase, st in by_phase.items()}
        for phase, graph in graphs.items():
            gm[phase.value] = timed(graph.replay, reset, dev, iters)
        if collectives is not None:
            gm["decode_collectives"] = timed(capture_graph(collectives, collectives=tp is not None).replay,
                                             lambda: None, dev, iters)
            gm["collectives_share"] = gm["decode_collectives"] / gm["decode"]
        if spec.speculative:
            n = spec.budget_at(B)
            one_round = round_steps(spec, B, n, context=False)
            gm["round"] = timed(lambda: r.graphs.replay(B, greedy, kv_len, one_round), reset, dev, iters)
            gm["round_in_decode_steps"] = gm["round"] / gm["decode"]
            lg = torch.randn(1, spec.depth, V, device=dev)
            root = torch.zeros(1, dtype=torch.long, device=dev)
            for nb in budgets_tree:
                # the builder the engine uses at this budget, and plain torch ops for reference
                engine_build = rounds.tree_builder(dev, nb)
                tg = capture_graph(lambda nb=nb, f=engine_build: f(lg, root, nb), collectives=tp is not None)
                gm[f"tree_build_alone_b{nb}"] = timed(tg.replay, lambda: None, dev, iters)
                tg = capture_graph(lambda nb=nb: build_tree(lg, root, nb), collectives=tp is not None)
                gm[f"tree_build_torch_ops_b{nb}"] = timed(tg.replay, lambda: None, dev, iters)
    return res


def _count(ops: list[tuple[str, tuple[int, ...], torch.dtype]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for op, shape, dtype in ops:
        key = f"{op} {'x'.join(map(str, shape))} {str(dtype).removeprefix('torch.')}"
        out[key] = out.get(key, 0) + 1
    return out


# The engine fields a phase timing depends on; the rest (graphs, scheduling, overlap) do not reach
# the phases timed here, which run one by one and capture graphs of their own.
ENGINE_FIELDS = ("model", "draft_model", "random_weights", "random_drafter", "spec", "block_size", "budget", "dtype",
                 "draft_quantization", "device", "max_model_len", "kv_cache_memory_gb", "gpu_memory_utilization",
                 "page_size", "deterministic", "tensor_parallel_size", "distributed_timeout_s")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m drafttree.bench.phases", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p.add_argument_group("engine"), ENGINE_FIELDS,
                    defaults={"spec": "ddtree", "budget": 32, "max_model_len": 2048},
                    notes={"budget": "here a fixed budget (auto is refused: the phases are timed at one)"})
    p.add_argument("--num-layers", type=int, default=None, help="with --random-weights: keep the first N layers")
    p.add_argument("--batch", type=int, default=1, help="requests in the round timed")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens of each request before the round")
    p.add_argument("--iters", type=int, default=30, help="timed runs of each phase (the median is reported)")
    p.add_argument("--tree-budgets", default="32,128,512",
                   help="CUDA: budgets at which the tree build alone is timed, comma-separated (empty: none)")
    p.add_argument("--out", default=None, help="also write the results (JSON) to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    if a.num_layers is not None:
        if not a.random_weights:
            p.error("--num-layers needs --random-weights")
        a.random_weights = f"{a.random_weights}@{a.num_layers}"
    if a.batch < 1:
        p.error(f"--batch must be >= 1, got {a.batch}")
    if a.budget == "auto":
        p.error("--budget: the phases are timed at a fixed budget (auto chooses one per round)")
    cfg = config_from_args(a, max_num_seqs=a.batch, cuda_graphs=False)
    args = (cfg, a.batch, a.prompt_len, a.iters, [int(x) for x in a.tree_budgets.split(",") if x])
    check_launch(cfg)
    if cfg.tensor_parallel_size == 1:
        res = bench(*args)
    else:
        res = run_ranks(_bench_rank, cfg.tensor_parallel_size, cfg.device, cfg.distributed_timeout_s, *args)
        if res is None:   # a torchrun rank other than 0: rank 0 reports
            return 0
    res["model"] = cfg.random_weights or cfg.model or "default"
    res["draft_quantization"] = cfg.draft_quantization
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


def _bench_rank(tp: TPGroup, *args) -> dict:
    return bench(*args, tp=tp)


if __name__ == "__main__":
    raise SystemExit(main())
