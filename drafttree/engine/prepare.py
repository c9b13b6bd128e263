"""The start-up stages around the weights: what ran before the engine (`launch`), the GPU's start
(`device`), then, after the weights, compiling (or reading from cache) the kernels, capturing
the CUDA graphs the engine can use, and the cost model (read from the cache where it was measured
before). Each reports to the engine's `StartupTimes` as it goes."""
from __future__ import annotations

import logging
import time

import torch

from drafttree import device_start
from drafttree.engine import caches
from drafttree.engine.plan import EngineSetup, graph_kv_lengths
from drafttree.engine.startup import StartupTimes
from drafttree.kernels import compile_cache
from drafttree.parallel.group import TPGroup
from drafttree.runner.cost import BUDGET_S, KEEP_SPREAD, CostTable, measure, timed_modes
from drafttree.runner.cuda_graph import first_sets
from drafttree.runner.model_runner import ModelRunner
from drafttree.runner.prefill_plan import PrefillLimits
from drafttree.settings import Settings, current

log = logging.getLogger(__name__)


def before_engine(startup: StartupTimes) -> None:
    """Stage "launch": the `drafttree` command's seconds before its engine began (imports, the
    tokenizer `generate` counts its prompt with); none outside the command (`drafttree.entry`
    forgets the launch time when it returns)."""
    launched = device_start.LAUNCHED_AT
    if launched is not None:
        startup.add("launch", time.perf_counter() - launched, "imports and what the command read before the engine")


def start_device(setup: EngineSetup, startup: StartupTimes) -> None:
    """Stage "device": the GPU's driver started and its context made (a memory query needs both),
    or waited for where the command began them at launch (`drafttree.device_start`)."""
    if setup.device.type != "cuda":
        return
    early = device_start.started()
    with startup.stage("device"):
        if early is not None:
            early.wait()
        torch.cuda.mem_get_info(setup.device)   # starts CUDA in torch (a no-op for what was begun at launch)
        startup.note("device", "started here" if early is None else
                     f"its start at launch failed ({early.error}); started here" if early.error else
                     f"begun at launch beside the imports: {early.seconds:.2f} s")


def compile_caches(setup: EngineSetup) -> dict[str, str]:
    """Point Triton and Inductor at this platform's directories under drafttree's cache, before
    anything compiles (on CUDA; the CPU compiles nothing unless asked)."""
    if setup.device.type != "cuda" and setup.settings.compile != "cpu":
        return {}
    if setup.device.type == "cuda":
        compile_cache.watch_triton()   # the start-up report says which kernels compiled for how long
    return compile_cache.install(setup.device)


def _compiled(dirs: dict[str, str]) -> int:
    return sum(compile_cache.entries(d) for d in dirs.values())


def _in_compile(since: float) -> str:
    """", N s in torch.compile" since `since` (compile_cache.compile_seconds()), if any."""
    spent = compile_cache.compile_seconds() - since
    return f", {spent:.1f} s in torch.compile" if spent >= 0.05 else ""


# Every step a graph captures ran eagerly in the stage "kernels" (compiled, Triton's kernels
# loaded, cuBLAS started): one eager run before each capture is left to do what a new shape
# needs (the allocator's blocks, a compiled piece's guards). The second run PyTorch's examples
# make took ~16 of a warm server's 118 s on an H100 (2 runs of 441 graphs: 32.9 s).
WARMUPS_AFTER_KERNELS = 1


def compiles_later(setup: EngineSetup, tp: TPGroup | None, settings: Settings) -> bool:
    """Whether an engine starts with its pieces as torch ops and compiles them after it serves,
    while idle (`capture_graphs`' compile_later): one that leaves graphs for later
    (defer_graphs, a server's), on one GPU, not deterministic, and compiling at all. Dynamo's
    tracing of every piece took 21.5 s of a warm server's start on an H100, and the pieces
    save ~11 % of a decode step: the graphs captured at start-up run them as torch ops until
    those captured again over the compiled ones replace them."""
    return setup.defer_graphs and tp is None and not settings.deterministic and settings.compile != "0"


def first_sets_only(setup: EngineSetup, settings: Settings) -> bool:
    """Whether an engine captures before it serves only the round graphs that serve every round
    (`RoundGraphs.first_sets`) and the rest while idle: one that leaves graphs for later
    (defer_graphs) and is not deterministic (a round in another set's graphs attends over more
    slots, the same tokens but not the same bits). A cost table still to measure is timed in
    those first (`cost_model`), and in its own modes while idle."""
    return setup.defer_graphs and not settings.deterministic


def capture_graphs(setup: EngineSetup, runner: ModelRunner, prefill: PrefillLimits | None,
                   startup: StartupTimes, dirs: dict[str, str], compile_later: bool = False,
                   first_only: bool = False) -> None:
    """Compile what a round runs (stage "kernels"), then capture the round graphs the setup asks
    for (a stage per phase, and their warm-ups) and the prefill graphs. `compile_later`: the
    pieces run as torch ops here; the steps are left to compile, and the round graphs captured
    here to be captured again, after the graphs left for later (`ModelRunner.compile_later`).
    `first_only` (`first_sets_only`): only the sets that serve every round here, the others while
    idle."""
    cache = runner.cache_cfg
    kv_lengths = graph_kv_lengths(cache, setup.cfg.max_graph_len)
    before, traced, triton = _compiled(dirs), compile_cache.compile_seconds(), compile_cache.TRITON.snapshot()
    # (the steps, at one row and at several: torch.compile specializes on 1; run again while idle
    # where the pieces compile later)
    kernel_steps = (setup.sampler_modes, cache.batch_buckets[:2], kv_lengths[0], setup.structured_graphs,
                    setup.processed_graphs)
    start_steps = kernel_steps
    if compile_later and first_only:
        # the compile steps, which run every step, come before the sets left for later are
        # captured: before /ready, the free steps of the first sets' modes are enough
        modes = {s.mode for s in first_sets(cache.batch_buckets, kv_lengths, setup.sampler_modes)}
        start_steps = (tuple(sorted(modes)), *kernel_steps[1:3], False, False)
    with startup.stage("kernels"):
        startup.progress("one eager round of each step")
        n = runner.warm_kernels(*start_steps)
        startup.note("kernels", f"{n} steps run, {_compiled(dirs) - before} files compiled into the cache"
                                + _in_compile(traced) + compile_cache.TRITON.since(triton))
    before, traced, triton = _compiled(dirs), compile_cache.compile_seconds(), compile_cache.TRITON.snapshot()
    now = not setup.defer_graphs
    with startup.running("graphs"):
        stages = runner.capture(setup.sampler_modes, prefill, cache.batch_buckets, kv_lengths, startup.progress,
                                constrained=setup.structured_graphs and now, processed=setup.processed_graphs and now,
                                later=(setup.structured_graphs and not now, setup.processed_graphs and not now),
                                prefill_later=not now, warmups=WARMUPS_AFTER_KERNELS, first_only=first_only)
    graphs, compiled = runner.graphs, _compiled(dirs) - before
    startup.parts["graph sets"] = {k.describe(): v for k, v in graphs.set_seconds.items()}
    left = len(graphs.sets()) - len(graphs.started)
    later = f"; {left} more sets later, while idle (their rounds replay these meanwhile)" if left else ""
    if any(graphs.later):
        later += "; the constrained and processed rounds' steps later, while idle"
    pg = runner.prefill_graphs
    if pg is not None and pg.pending:
        later += f"; {len(pg.pending)} prefill graphs later, while idle (eager prefill meanwhile)"
    startup.note("graphs warm-up", f"{len(graphs.graphs)} round graphs in {len(graphs.set_seconds)} sets"
                                   + (f", {compiled} files compiled" if compiled else "") + _in_compile(traced)
                                   + compile_cache.TRITON.since(triton) + later)
    for stage, seconds in stages.items():
        startup.add(stage, seconds)
    if compile_later:
        runner.compile_later(*kernel_steps)
        startup.note("kernels", startup.notes.get("kernels", "") + "; the pieces as torch ops: "
                     f"{len(runner.compile_jobs)} steps compile and {len(runner.graphs.upgrade)} graph sets are "
                     "captured again over them after start-up, while idle")


def _cost_key(setup: EngineSetup, runner: ModelRunner) -> dict:
    """The cost table's key, the same before the graphs are captured as after: it is timed at the
    shortest KV bucket the engine captures (`cost.measure`)."""
    graphed = setup.cuda_graphs
    kv_len = graph_kv_lengths(runner.cache_cfg, setup.cfg.max_graph_len)[0] if graphed else runner.round_kv_len(64)
    return caches.cost_key(setup, runner.cache_cfg.batch_buckets, kv_len, graphed, current())


def cost_model(setup: EngineSetup, runner: ModelRunner, tp: TPGroup | None,
               startup: StartupTimes) -> tuple[CostTable, bool]:
    """The cost table: read from the cache where this engine on this machine measured it before,
    else measured (within `runner.cost.BUDGET_S`) and kept for later starts.
    Where the start captured the first sets only (`first_sets_only`), the graphs of the modes a table
    is timed in are still to come: it is timed in the first sets' mode at the shortest KV bucket
    (the most general: what every round may pay, greedy rounds a little less), not kept, and
    True is returned: time it again in its own modes while idle (`ModelRunner.begin_costs`)."""
    assert (runner.graphs is not None) == setup.cuda_graphs
    traced = compile_cache.compile_seconds()
    later = False
    with startup.stage("cost model"):
        table = caches.load_costs(setup, _cost_key(setup, runner), runner.cache_cfg.batch_buckets,
                                  runner.drafter is not None, tp)
        if table is None:
            modes = setup.sampler_modes
            graphs = runner.graphs
            if graphs is not None and graphs.pending:
                short = graphs.kv_lengths[0]
                have = tuple(sorted({s.mode for s in graphs.started if s.kv_len == short}))
                later = any(m not in have for m in timed_modes(modes))
                modes = have if later else modes
            table = measure(runner, modes=modes, progress=startup.progress)
            note = measured_note(table) + ("; provisional (timed in the first sets' " + ", ".join(m.name.lower() for m in modes)
                                       + " graphs), timed again in its own modes while idle" if later
                                       else keep_costs(setup, runner, tp, table))
        else:
            note = "read from the cache"
        startup.note("cost model", note + _in_compile(traced))
    return table, later


def measured_note(table: CostTable) -> str:
    """What the start-up report says of a measured table."""
    estimated = len(table.estimated)
    return f"measured {len(table.seconds) - estimated} entries" + \
        (f", {estimated} scaled from them: its {BUDGET_S:g} s budget ran out" if estimated else "")


def keep_costs(setup: EngineSetup, runner: ModelRunner, tp: TPGroup | None, table: CostTable) -> str:
    """Keep a measured table for later starts (rank 0; not one timed under a changing load, which
    the next start measures again); returns what to say of it ("" where kept)."""
    if table.worst_spread() > KEEP_SPREAD:
        return f"; not kept (an entry's spread {100 * table.worst_spread():.0f} %)"
    if tp is None or tp.leader:
        try:
            caches.save_costs(table, _cost_key(setup, runner))
        except OSError as e:
            log.warning("the cost table is not kept for later starts: %s", e)
    return ""
