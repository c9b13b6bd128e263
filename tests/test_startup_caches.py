"""Start-up: the stage report and its progress lines, the cost table kept between runs (a hit
measures nothing, any change of what it depends on misses), the cost model's budget, what
`generate` captures, the KV buckets up to max_graph_len, `drafttree cache` and the compiled
kernels' directory. CPU only, tiny models (the graphs shared between modes and KV buckets:
tests/test_cuda_graphs.py, over its fake graphs)."""
from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from drafttree import LLM, SamplingParams
from drafttree.engine.engine import Engine, EngineConfig
from drafttree.engine import caches, prepare
from drafttree.engine.plan import graph_kv_lengths
from drafttree.engine.startup import Background, StartupTimes
from drafttree.kernels import compile_cache
from drafttree.phases import Phase
from drafttree.runner import cost
from drafttree.runner.model_runner import CacheConfig, ModelRunner
from tests.tiny import make_drafter, make_target, write_tokenizer

VOCAB = 61


@pytest.fixture(autouse=True)
def kept_whatever_its_spread(monkeypatch):
    """A tiny model's forwards take microseconds, which a loaded test machine spreads widely: the
    tests of what is kept keep every table (the spread rule has its own test)."""
    monkeypatch.setattr(prepare, "KEEP_SPREAD", float("inf"))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("startup")
    t = make_target(root / "t", "qwen3", vocab=VOCAB, layers=2, scale=3.0)
    write_tokenizer(t, VOCAB)
    return t, make_drafter(root / "d", t, block_size=4, target_layer_ids=[0, 1])


def _kw(pair, **kw):
    t, d = pair
    return {**dict(model=str(t), draft_model=str(d), spec="ddtree", device="cpu", dtype="float32", max_num_seqs=1,
                   max_model_len=64), **kw}


# -- the report ----------------------------------------------------------------------------------
def test_stage_lines_and_progress_lines_while_a_stage_runs():
    lines: list[str] = []
    st = StartupTimes(every_s=0.05, emit=lines.append)
    with st.stage("load weights"):
        st.progress("layer 3 of 30")
        time.sleep(0.3)
    with st.running("graphs"):
        time.sleep(0.15)
    st.add("graphs decode", 0.5, note="12 graphs")
    progress = [x for x in lines if "so far" in x]
    assert len(progress) >= 3 and all(x.startswith("start-up: load weights: layer 3 of 30, ") for x in progress[:3])
    assert any(x.startswith("start-up: graphs: ") for x in progress)
    done = [x for x in lines if "so far" not in x]
    assert done[0].startswith("start-up: load weights") and done[0].endswith(" s")
    assert done[1] == f"start-up: {'graphs decode':<22} {0.5:8.2f} s  (12 graphs)"
    assert list(st.stages) == ["load weights", "graphs decode"] and st.stages["load weights"] >= 0.3
    rec = st.record()
    assert rec["notes"] == {"graphs decode": "12 graphs"} and rec["total_s"] == pytest.approx(st.total, abs=1e-3)
    time.sleep(0.2)   # the progress thread ends with the last running stage
    assert not any(t.name == "drafttree-startup-progress" for t in threading.enumerate())
    n = len(lines)
    time.sleep(0.15)
    assert len(lines) == n


def test_background_work_returns_or_raises_where_it_is_waited_for():
    assert Background(lambda: 7).result() == 7
    bad = Background(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        bad.result()


# -- the cost table kept between runs ------------------------------------------------------------
def _measures(monkeypatch) -> list[int]:
    """Counts the cost model's measurements."""
    seen: list[int] = []
    real = prepare.measure
    monkeypatch.setattr(prepare, "measure", lambda *a, **k: seen.append(1) or real(*a, **k))
    return seen


def test_a_kept_cost_table_is_read_back_and_any_change_measures_again(pair, set_settings, monkeypatch, tmp_path):
    set_settings(cache=tmp_path)
    measured = _measures(monkeypatch)
    first = LLM(**_kw(pair)).engine
    assert measured == [1] and first.startup.notes["cost model"].startswith("measured")
    assert len(list((tmp_path / "costs").glob("*.json"))) == 1
    again = LLM(**_kw(pair)).engine   # the same engine on the same machine: nothing timed
    assert measured == [1] and again.startup.notes["cost model"] == "read from the cache"
    assert again.costs.seconds == first.costs.seconds and again.costs.estimated == first.costs.estimated
    assert "read from the cache" in again.costs.format()
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    assert LLM(**_kw(pair)).generate([[3, 4, 5]], sp)[0].token_ids == \
        LLM(**_kw(pair, spec="none", draft_model=None)).generate([[3, 4, 5]], sp)[0].token_ids

    def misses(**kw) -> None:
        n = len(measured)
        LLM(**_kw(pair, **kw))
        assert len(measured) == n + 1, kw

    misses(max_num_seqs=2)                      # another batch bucket to time
    misses(budget_schedule="1:4")               # another spec
    misses(sampler_modes=("greedy",))           # another pick timed
    set_settings(cache=tmp_path, attn_kernel=False)
    misses()                                    # other settings
    set_settings(cache=tmp_path, attn_kernel=True)
    t, d = pair
    weights = t / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    try:
        misses()                                # the target's weights changed
    finally:
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    (d / "config.json").write_text((d / "config.json").read_text() + "\n")
    misses()                                    # the drafter's config changed
    real = compile_cache.platform
    monkeypatch.setattr(compile_cache, "platform", lambda device=None: {**real(device), "device": "another"})
    misses()                                    # another machine (GPU, driver, torch, Triton)
    monkeypatch.setattr(compile_cache, "platform", real)
    monkeypatch.setattr(caches, "source_digest", lambda: "another drafttree")
    misses()                                    # another drafttree
    blocks = tmp_path / "blocks.json"
    blocks.write_text('{"gemv": []}')
    set_settings(cache=tmp_path, blocks=str(blocks))
    misses()                                    # kernel block shapes from a file
    blocks.write_text('{"gemv": [[1, 2]]}')
    misses()                                    # the same file, other shapes in it


def test_a_damaged_cost_table_is_measured_again(pair, set_settings, monkeypatch, tmp_path):
    set_settings(cache=tmp_path)
    measured = _measures(monkeypatch)
    LLM(**_kw(pair))
    (path,) = (tmp_path / "costs").glob("*.json")
    path.write_text("{not json")
    assert LLM(**_kw(pair)).engine.startup.notes["cost model"].startswith("measured") and len(measured) == 2
    path.write_text("[]")   # JSON, not a table
    assert LLM(**_kw(pair)).engine.startup.notes["cost model"].startswith("measured") and len(measured) == 3


def test_the_cost_model_keeps_to_its_budget(pair, set_settings, tmp_path):
    """Past its budget the cost model times nothing more: every entry left is scaled from the
    timed ones, and the table still prices every round."""
    set_settings(cache=tmp_path)
    runner = LLM(**_kw(pair, max_num_seqs=4)).engine.runner
    buckets = runner.cache_cfg.batch_buckets
    full = cost.measure(runner, budget_s=60.0)
    assert not full.estimated and full.covers(buckets)
    none_left = cost.measure(runner, budget_s=0.0)
    assert len(none_left.seconds) - len(none_left.estimated) == 1 and none_left.covers(buckets)
    assert set(none_left.seconds) == set(full.seconds)
    calls = []
    slow = 0.02   # seconds per token of a forward, run reps + 1 times

    def time_runs(st, B, mode, kv_len, reps, warmups=1):
        calls.append((st, B))
        time.sleep(slow * B * st.width * (reps + warmups))
        return [slow * B * st.width] * reps
    runner.time_runs = time_runs
    t0 = time.perf_counter()
    table = cost.measure(runner, budget_s=1.0)
    first = slow * runner.spec.width(Phase.CONTEXT) * (cost.CPU_REPS + 1)   # the context write at batch 1
    assert time.perf_counter() - t0 < first + 1.0 + 0.5
    assert table.estimated and len(calls) < len(table.seconds) and table.covers(buckets)
    decode = table.get(Phase.DECODE, 4, 1)
    assert decode == pytest.approx(slow * 4, rel=0.01)   # timed, or scaled in proportion to tokens
    # every bucket's plain round and narrowest verify first, the widest verifies next
    passes = [cost._timing_pass(runner.spec, B, st) for st, B in calls]
    assert passes == sorted(passes) and passes[0] == 0
    # a verify between two timed widths of its bucket and pick: on the line through them
    t = cost.CostTable(runner.spec, {(Phase.VERIFY, 1, 5, False): 0.050, (Phase.VERIFY, 1, 33, False): 0.120})
    assert cost._scaled(t, (Phase.VERIFY, 1, 9, False)) == pytest.approx(0.050 + 0.070 * 4 / 28)
    # beyond the narrowest timed verify, on the line from the decode step (width 1) through it
    t = cost.CostTable(runner.spec, {(Phase.DECODE, 2, 1, True): 0.040, (Phase.VERIFY, 2, 5, True): 0.060})
    assert cost._scaled(t, (Phase.VERIFY, 2, 9, True)) == pytest.approx(0.080)


def test_a_table_timed_under_a_changing_load_is_not_kept(pair, set_settings, monkeypatch, tmp_path):
    """An entry whose runs spread past KEEP_SPREAD: the engine uses the table, keeps none, says so,
    and the next start measures again."""
    set_settings(cache=tmp_path)
    measured = _measures(monkeypatch)
    monkeypatch.setattr(prepare, "KEEP_SPREAD", 0.10)
    wide = itertools.cycle([0.010, 0.015, 0.022])   # runs of 10, 15 and 22 ms in turn: every entry spreads
    monkeypatch.setattr(ModelRunner, "time_runs", lambda self, st, B, mode, kv_len, reps, warmups=1:
                        [next(wide) for _ in range(reps)])
    eng = LLM(**_kw(pair)).engine
    assert eng.costs.worst_spread() > 0.10 and "not kept" in eng.startup.notes["cost model"]
    assert not list((tmp_path / "costs").glob("*.json"))
    LLM(**_kw(pair))
    assert measured == [1, 1]


# -- what a run captures -------------------------------------------------------------------------
def _generate_args(*argv: str) -> tuple:
    from drafttree.cli import build_parser, engine_config
    a = build_parser().parse_args(["generate", "Hello", *argv])
    return a, engine_config(a)


def test_generate_captures_what_its_one_request_can_use(pair, monkeypatch):
    from drafttree import config as config_mod
    from drafttree.cli import generate_config
    t, d = pair
    a, cfg = _generate_args("--model", str(t), "--draft-model", str(d), "--device", "cpu")
    got, tok = generate_config(cfg, a)
    assert (got.max_num_seqs, got.sampler_modes, got.prefill_graphs, got.max_graph_len) == (1, ("greedy",), False, None)
    assert tok is None   # no graphs, no count: the engine loads its tokenizer alongside the weights
    for flags, mode in ((("--temperature", "0.7"), "sample"), (("--temperature", "0.7", "--top-p", "0.9"), "filtered")):
        a, cfg = _generate_args("--model", str(t), "--draft-model", str(d), "--device", "cpu", *flags)
        assert generate_config(cfg, a)[0].sampler_modes == (mode,)
    # no graphs and no budget chosen per round (no drafter, --spec none, a fixed budget): no mode
    # to choose, so none is set (and the engine does not warn of an option nobody gave)
    for flags in ((), ("--draft-model", str(d), "--spec", "none"), ("--draft-model", str(d), "--budget", "8")):
        a, cfg = _generate_args("--model", str(t), "--device", "cpu", *flags)
        assert generate_config(cfg, a)[0].sampler_modes is None, flags
    # flags given win
    a, cfg = _generate_args("--model", str(t), "--device", "cpu", "--max-num-seqs", "4", "--sampler-modes",
                            "greedy,sample", "--prefill-graphs")
    got, _ = generate_config(cfg, a)
    assert (got.max_num_seqs, got.sampler_modes, got.prefill_graphs) == (4, ("greedy", "sample"), True)
    # with CUDA graphs, the KV buckets its prompt and --max-tokens reach; the tokenizer that
    # counted the prompt is returned for the engine
    monkeypatch.setattr(config_mod, "resolve_device", lambda device=None: torch.device("cuda"))
    a, cfg = _generate_args("--model", str(t), "--max-tokens", "20")
    got, tok = generate_config(cfg, a)
    assert got.max_graph_len == len("Hello") + 20 and tok is not None and tok.encode("Hello") is not None
    a, cfg = _generate_args("--model", str(t), "--max-graph-len", "99")
    assert generate_config(cfg, a)[0].max_graph_len == 99


def test_generate_runs_the_fused_pieces_uncompiled_unless_told(pair, monkeypatch):
    """`generate` starts its engine with torch.compile off (its process's settings, which the ranks
    it spawns take: `test_spawned_ranks_take_rank_zeros_settings`) unless the environment sets
    DRAFTTREE_COMPILE; the environment itself is left as it was."""
    from drafttree import cli, settings
    from drafttree.engine import launch
    t, d = pair
    seen = []

    class Started(Exception):
        pass

    def start(cfg, tok=None):
        seen.append((settings.current().compile, os.environ.get("DRAFTTREE_COMPILE")))
        raise Started
    monkeypatch.setattr(launch, "start_engine", start)
    for env, want in ((None, "0"), ("1", "1"), ("cpu", "cpu")):   # (conftest sets the default back after)
        if env is None:
            monkeypatch.delenv("DRAFTTREE_COMPILE", raising=False)
        else:
            monkeypatch.setenv("DRAFTTREE_COMPILE", env)
        settings.install(settings.Settings.from_env())
        with pytest.raises(Started):
            cli.main(["generate", "Hello", "--model", str(t), "--draft-model", str(d), "--device", "cpu"])
        assert seen.pop() == (want, env)


def test_spawned_ranks_take_rank_zeros_settings(pair, monkeypatch):
    """The ranks an engine spawns build theirs under rank 0's settings (here a scope of its
    thread's, which their environment would not give them)."""
    from drafttree.engine import launch
    from drafttree.engine.engine import EngineConfig
    from drafttree.settings import using
    t, d = pair
    got = []

    class Spawned(Exception):
        pass

    def spawn(target, world, args_of, timeout_s):
        got.append(args_of(1))
        raise Spawned
    monkeypatch.setattr(launch, "spawn_ranks", spawn)
    cfg = EngineConfig(model=str(t), draft_model=str(d), device="cpu", tensor_parallel_size=2)
    with using(compile="0", attn_kernel=False, pdl=False), pytest.raises(Spawned):
        launch.start_engine(cfg)
    settings = got[0][-1]
    assert (settings.compile, settings.attn_kernel, settings.pdl) == ("0", False, False)


def test_an_engine_takes_the_tokenizer_it_is_given(pair, monkeypatch):
    """A tokenizer the caller loaded already (the command line counted its prompt with it) is the
    engine's: not loaded a second time."""
    import drafttree.engine.engine as engine_mod
    from drafttree.engine.text import load_tokenizer
    t, _ = pair
    tok = load_tokenizer(t)
    loads = []
    monkeypatch.setattr(engine_mod, "load_tokenizer", lambda path: loads.append(path))
    eng = Engine(EngineConfig(model=str(t), device="cpu", spec="none", max_model_len=64), tokenizer=tok)
    assert eng.tokenizer is tok and not loads
    eng.shutdown()


def test_graph_kv_lengths_up_to_max_graph_len():
    c = CacheConfig(1, 8192, 9)
    assert c.kv_buckets == [1024, 4096, 8201]
    assert graph_kv_lengths(c, None) == c.kv_buckets and graph_kv_lengths(c, 10**6) == c.kv_buckets
    assert graph_kv_lengths(c, 100) == [1024] and graph_kv_lengths(c, 1015) == [1024]
    assert graph_kv_lengths(c, 1016) == [1024, 4096]


# -- drafttree cache -----------------------------------------------------------------------------
def test_cache_command_shows_and_clears_each_part(set_settings, tmp_path, capsys):
    from drafttree.cli import main
    set_settings(cache=tmp_path)
    for part, n in (("models", 2), ("compiled", 3), ("costs", 1)):
        (tmp_path / part / "x").mkdir(parents=True)
        for i in range(n):
            (tmp_path / part / "x" / f"f{i}").write_bytes(b"0" * 1024)
    assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path) in out and "total           6 files" in out
    assert all(f"{p:<9} {n:>7} files" in out for p, n in (("models", 2), ("compiled", 3), ("costs", 1)))
    assert main(["cache", "clear", "costs", "compiled"]) == 0
    assert "cleared costs: 1 files" in capsys.readouterr().out
    assert not (tmp_path / "costs").exists() and not (tmp_path / "compiled").exists() and (tmp_path / "models").exists()
    assert main(["cache", "clear", "weights"]) == 2
    assert "unknown cache part ['weights']: choose from models, compiled, costs" in capsys.readouterr().err
    assert main(["cache", "info", "costs"]) == 2
    assert main(["cache", "clear"]) == 0 and not (tmp_path / "models").exists()


def test_compiled_kernels_go_under_the_cache_in_a_directory_of_the_platform(set_settings, monkeypatch, tmp_path):
    set_settings(cache=tmp_path)
    monkeypatch.delenv(compile_cache.TRITON_ENV, raising=False)
    monkeypatch.setenv(compile_cache.INDUCTOR_ENV, str(tmp_path / "mine"))
    dirs = compile_cache.install("cpu")
    base = compile_cache.compiled_dir("cpu")
    assert dirs == {"triton": str(base / "triton"), "inductor": str(tmp_path / "mine")}
    info = compile_cache.platform("cpu")
    assert info["device"].startswith("cpu: ") and info["threads"] == torch.get_num_threads() and info["torch"]


def test_a_server_captures_the_constrained_and_processed_graphs_after_ready():
    """`serve` defers the constrained and processed rounds' graphs where it captures graphs (CUDA),
    unless told otherwise; elsewhere the setting is left as given."""
    pytest.importorskip("fastapi")
    from drafttree.server.app import serve_config
    assert serve_config(EngineConfig(device="cuda")).defer_graphs is True
    assert serve_config(EngineConfig(device="cuda", defer_graphs=False)).defer_graphs is False
    assert serve_config(EngineConfig(device="cuda", cuda_graphs=False)).defer_graphs is None
    assert serve_config(EngineConfig(device="cpu")).defer_graphs is None


def test_a_stage_note_gives_the_seconds_spent_in_torch_compile(monkeypatch):
    """The start-up notes' "N s in torch.compile" is Dynamo's own counter over the stage: what its
    compiled pieces cost, cache hits included."""
    import torch._dynamo.utils as dynamo_utils

    from drafttree.engine.prepare import _in_compile
    from drafttree.kernels import compile_cache
    monkeypatch.setitem(dynamo_utils.compilation_time_metrics, "_compile.compile_inner", [1.5, 2.0])
    assert compile_cache.compile_seconds() == 3.5
    assert _in_compile(1.0) == ", 2.5 s in torch.compile"
    assert _in_compile(3.5) == ""


def test_generate_as_a_process_reports_its_launch_and_exits_at_its_answer(pair, tmp_path):
    """The command as a process: its `launch` stage (what ran before the engine) is reported, the
    answer and its rate line are written in full, and the process ends with the command's code
    (its teardown skipped after the output is flushed)."""
    t, d = pair
    env = {**os.environ, "DRAFTTREE_CACHE": str(tmp_path / "cache"), "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, "-m", "drafttree", "generate", "Hello", "--model", str(t), "--draft-model",
                        str(d), "--device", "cpu", "--max-tokens", "6", "--raw"], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parent.parent, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert re.search(r"start-up: launch +\d+\.\d+ s", r.stderr), r.stderr[-2000:]
    assert "start-up: device" not in r.stderr   # the CPU has no device stage
    assert re.search(r"\[6 tokens in [\d.]+ s", r.stderr), r.stderr[-2000:]
    bad = subprocess.run([sys.executable, "-m", "drafttree", "generate", "Hello", "--model", str(tmp_path / "none"),
                          "--device", "cpu"], capture_output=True, text=True, env=env, timeout=300,
                         cwd=Path(__file__).resolve().parent.parent)
    assert bad.returncode != 0


@pytest.mark.parametrize("argv, env, want", [
    ([], {}, True),
    (["--device", "cuda"], {}, True),
    (["--device=cuda:0"], {}, True),
    (["--device", "cpu"], {}, False),
    (["--device", "cuda:1"], {}, False),
    ([], {"LOCAL_RANK": "3"}, False),          # torchrun's other ranks use other GPUs
    ([], {"CUDA_VISIBLE_DEVICES": ""}, False),
    ([], {"DRAFTTREE_EARLY_DEVICE": "0"}, False),
])
def test_the_gpu_starts_at_launch_only_for_a_process_on_the_first_gpu(argv, env, want):
    from drafttree import device_start
    assert device_start.wanted(["Hello", *argv], env) is want


def test_the_gpu_start_at_launch_ends_done_or_says_why():
    """Begun in its thread, the start ends either with the driver and device 0's context made
    (a machine with a GPU) or with why not (none here), never with an exception."""
    import torch

    from drafttree.device_start import DeviceStart
    s = DeviceStart().start()
    assert s.wait(60)
    assert s.seconds is not None and s.seconds >= 0
    if torch.cuda.is_available():
        assert s.error is None
    else:
        assert isinstance(s.error, str) and s.error


def test_triton_compiles_are_counted_per_kernel_beside_hooks_set_before(monkeypatch):
    """The start-up report's Triton figures: each first use of a kernel's specialization between
    Triton's two hooks counts once with its seconds; hooks set before are kept and called, and
    one that asks to skip the compilation is obeyed and nothing is counted; installed once."""
    from types import SimpleNamespace

    knobs = pytest.importorskip("triton").knobs
    calls = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: calls.append(("pre", kw["key"])) or kw["key"] == "skip")
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: calls.append(("post", kw["key"])))
    monkeypatch.setattr(compile_cache, "TRITON", compile_cache.TritonWatch())
    compile_cache.watch_triton()
    compile_cache.watch_triton()
    snap = compile_cache.TRITON.snapshot()

    def compile_(name: str, key: str) -> None:
        kw = dict(key=key, repr=name, fn=SimpleNamespace(name=name, module="m"), compile={}, is_manual_warmup=False,
                  already_compiled=False)
        if not knobs.runtime.jit_cache_hook(**kw):
            time.sleep(0.01)
            knobs.runtime.jit_post_compile_hook(**kw)

    for name, key in (("attn", "a"), ("attn", "b"), ("norm", "a"), ("attn", "skip")):
        compile_(name, key)
    w = compile_cache.TRITON
    assert w.first_uses == {"attn": 2, "norm": 1} and w.seconds["attn"] >= 0.02 and w.seconds["norm"] >= 0.01
    assert calls == [("pre", "a"), ("post", "a"), ("pre", "b"), ("post", "b"), ("pre", "a"), ("post", "a"), ("pre", "skip")]
    said = w.since(snap)
    assert said.startswith(", Triton: 3 first uses in ") and "(most: attn 2x" in said and "norm 1x" in said
    assert w.since(w.snapshot()) == ""
    knobs.runtime.jit_cache_hook(key="odd", fn=object())   # hooks of another Triton's arguments: counted
    knobs.runtime.jit_post_compile_hook(key="odd")         # as they can be, never raising into a compile


def test_a_server_start_times_its_cost_table_in_the_first_sets_then_in_its_own_modes_while_idle(
        pair, set_settings, fake_cuda_graphs, tmp_path, caplog):
    """A server's start (defer_graphs) with no cost table kept captures the first sets only; its
    table is timed in their mode (provisional: greedy rounds priced as sampled ones, not kept), and
    again in its own modes while idle, an entry a call after the graphs: then the engine prices
    from it and keeps it, and the next start reads it."""
    from drafttree.engine.engine import Engine
    from drafttree.runner.cost import entries
    from drafttree.runner.cuda_graph import first_sets, set_keys

    set_settings(cache=tmp_path)
    kw = dict(_kw(pair, max_num_seqs=2), cuda_graphs=True, prefill_graphs=False, defer_graphs=True)
    eng = Engine(EngineConfig(**kw))
    rg, job = eng.runner.graphs, eng.runner.cost_job
    first = first_sets(eng.runner.cache_cfg.batch_buckets, rg.kv_lengths, rg.modes)
    assert set(rg.graphs) == set_keys(eng.spec, first, True, False, False)   # the first sets' alone
    assert "provisional" in eng.startup.notes["cost model"] and not list(tmp_path.glob("costs/*.json"))
    assert eng.costs is not None and not any(key[3] is False and key[0].value in ("decode", "verify")
                                              for key in eng.costs.seconds)   # timed as sampled rounds
    assert eng.chooser.costs is eng.costs and job is not None and job.left > 0
    assert eng.graphs_pending == len(eng.runner.compile_jobs) + len(rg.pending) + len(rg.upgrade) + job.left
    with caplog.at_level("INFO"):
        while rg.pending or rg.upgrade or eng.runner.compile_jobs:
            eng.capture_later()
        n = job.left
        assert eng.capture_later() == (n > 1) and job.left == n - 1   # an entry a call
        while eng.capture_later():
            pass
    assert eng.runner.cost_job is None and eng.costs is job.table and eng.chooser.costs is job.table
    timed = {key for key in job.table.seconds if key not in job.table.estimated}
    assert any(key[3] is False and key[0].value == "decode" for key in timed)   # greedy rounds timed as such
    assert {st.phase for st, _ in entries(eng.spec, 1)} <= {key[0] for key in job.table.seconds}
    assert any("cost table done" in r.message for r in caplog.records)
    assert any(r.message.startswith("cost model timed while idle") for r in caplog.records)
    assert len(list(tmp_path.glob("costs/*.json"))) == 1
    eng.shutdown()
    again = Engine(EngineConfig(**kw))
    assert again.startup.notes["cost model"] == "read from the cache" and again.runner.cost_job is None
    assert again.costs.seconds == job.table.seconds
    again.shutdown()
