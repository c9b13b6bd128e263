"""The settings object (`drafttree.settings`): the DRAFTTREE_* variables parsed once, bad values
refused by name, shown by `drafttree graphs` and recorded in bench results; scopes per thread, and
each engine's own settings in force wherever it runs model code."""
from __future__ import annotations

import dataclasses
import json
import logging
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from drafttree import settings
from drafttree.settings import Settings, current, install, process_default, scope, using


def test_defaults_and_every_variable(tmp_path):
    assert Settings.from_env({}) == Settings()
    d = Settings()
    assert (d.attn_kernel, d.gemv, d.gemm, d.moe_kernel, d.pdl, d.deterministic, d.blocks, d.compile) == (
        True, True, True, True, True, False, None, "1")
    assert d.cache == Path.home() / ".cache" / "drafttree"
    blocks = tmp_path / "best.json"
    blocks.write_text("[]")
    env = {"DRAFTTREE_ATTN_KERNEL": "0", "DRAFTTREE_GEMV": "0", "DRAFTTREE_GEMM": "0", "DRAFTTREE_MOE_KERNEL": "0",
           "DRAFTTREE_PDL": "0", "DRAFTTREE_DETERMINISTIC": "1", "DRAFTTREE_BLOCKS": str(blocks),
           "DRAFTTREE_COMPILE": "cpu",
           "DRAFTTREE_CACHE": "~/elsewhere"}
    s = Settings.from_env(env)
    assert s == Settings(attn_kernel=False, gemv=False, gemm=False, moe_kernel=False, pdl=False, deterministic=True,
                         blocks=str(blocks), compile="cpu", cache=Path("~/elsewhere").expanduser())
    assert Settings.from_env({k: "" for k in env}) == Settings()   # empty: unset
    assert {settings.env_name(f.name) for f in dataclasses.fields(Settings)} == set(env)


@pytest.mark.parametrize("name,value,says", [
    ("DRAFTTREE_GEMV", "yes", "expected 0 (off) or 1 (on)"),
    ("DRAFTTREE_PDL", "2", "expected 0 (off) or 1 (on)"),
    ("DRAFTTREE_ATTN_KERNEL", "off", "expected 0 (off) or 1 (on)"),
    ("DRAFTTREE_COMPILE", "fast", "expected 0 (off), 1 (CUDA tensors) or cpu"),
    ("DRAFTTREE_BLOCKS", "/no/such/file.json", "no such file"),
])
def test_a_bad_value_is_refused_naming_the_variable(name, value, says):
    with pytest.raises(ValueError, match=f"^{name}=.*{re.escape(says)}"):
        Settings.from_env({name: value})


def test_bad_fields_refused_when_made_in_code():
    with pytest.raises(ValueError, match="DRAFTTREE_COMPILE"):
        Settings(compile="fast")
    with pytest.raises(ValueError, match="DRAFTTREE_GEMM"):
        Settings(gemm=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        Settings().gemv = False


def test_an_unknown_variable_is_logged_once(caplog):
    env = {"DRAFTTREE_FUSED_TREE_TYPO": "0"}
    with caplog.at_level(logging.WARNING, logger="drafttree.settings"):
        assert Settings.from_env(env) == Settings()
        Settings.from_env(env)
    assert caplog.text.count("DRAFTTREE_FUSED_TREE_TYPO") == 1 and "not a drafttree setting" in caplog.text


def test_describe_and_as_dict():
    s = Settings(gemm=False, compile="0", cache=Path("/tmp/c"))
    assert s.describe() == ("attn_kernel=on gemv=on gemm=off moe_kernel=on pdl=on deterministic=off blocks=- "
                            "compile=0 cache=/tmp/c")
    d = s.as_dict()
    assert d == {"attn_kernel": True, "gemv": True, "gemm": False, "moe_kernel": True, "pdl": True,
                 "deterministic": False, "blocks": None, "compile": "0", "cache": "/tmp/c"}
    assert json.loads(json.dumps(d)) == d


def test_current_reads_the_environment_once_and_install_replaces_it(monkeypatch):
    monkeypatch.setattr(settings, "_current", None)
    monkeypatch.setenv("DRAFTTREE_GEMM", "0")
    first = current()
    assert first.gemm is False
    monkeypatch.setenv("DRAFTTREE_GEMM", "1")
    assert current() is first   # read once: a later change of the environment is not seen
    mine = Settings(pdl=False)
    assert install(mine) is first and current() is mine
    with using(attn_kernel=False) as inside:
        assert current() is inside and inside == mine.replace(attn_kernel=False)
    assert current() is mine


def test_graph_plan_and_bench_results_show_the_settings(zoo, set_settings):
    from drafttree.bench.environment import environment
    from drafttree.engine.engine import EngineConfig
    from drafttree.engine.plan import describe_plan
    set_settings(gemm=False)
    text = describe_plan(EngineConfig(model=str(zoo("qwen3").target)))
    assert f"settings: {current().describe()}\n" in text and "gemm=off" in text
    # an engine config's deterministic choice is what its engine runs under
    assert "deterministic=on" in describe_plan(EngineConfig(model=str(zoo("qwen3").target), deterministic=True))
    env = environment()
    assert env["settings"] == current().as_dict() and env["kernels"]["few_row_projections"] is False


def test_a_scope_holds_in_its_own_thread_only(monkeypatch):
    """Two threads in scopes of their own each see theirs; a new thread starts outside any scope
    (the process default), and install() inside a scope changes the default, not the scope."""
    monkeypatch.setattr(settings, "_current", Settings())
    base = current()
    mine, theirs = Settings(gemm=False), Settings(pdl=False)
    both_in, seen = threading.Barrier(2), {}

    def other() -> None:
        seen["fresh"] = current()
        with scope(theirs):
            both_in.wait()
            seen["scoped"] = current()
            both_in.wait()
    t = threading.Thread(target=other)
    with scope(mine):
        t.start()
        both_in.wait()
        assert current() is mine
        both_in.wait()
        t.join()
        later = Settings(attn_kernel=False)
        assert install(later) is base and current() is mine and process_default() is later
    assert seen["scoped"] is theirs and seen["fresh"] is base and current() is later


def test_a_traced_forward_reads_the_scope_and_is_guarded_on_it():
    """torch.compile traces a read of the settings in one graph (a forward it traces reads them),
    and the graph traced under one scope is not reused under another."""
    import torch

    def forward(x):
        return x * 2 if current().gemm else x * 3
    torch._dynamo.reset()
    traced = torch.compile(forward, backend="eager", fullgraph=True)
    x = torch.ones(2)
    with scope(Settings(gemm=True)):
        assert torch.equal(traced(x), x * 2)
    with scope(Settings(gemm=False)):
        assert torch.equal(traced(x), x * 3)


def _engine(target, **kw):
    from drafttree.engine.engine import Engine, EngineConfig
    return Engine(EngineConfig(model=str(target), spec="none", device="cpu", dtype="float32", max_num_seqs=2,
                               max_model_len=32, kv_cache_memory_gb=0.01, **kw))


def test_two_engines_keep_their_own_settings(zoo, monkeypatch):
    """One deterministic engine and one not, in one process: every forward of each (its
    construction, its warm-up, its steps taken in turn with the other's) runs under its own
    settings, and the process default is what it was. (One process-wide object, installed by each
    engine's start, gave the first engine the second's.)"""
    from drafttree.engine import engine as engine_module
    from drafttree.engine.warmup import warm_up
    from drafttree.kernels import dispatch
    from drafttree.sampling import SamplingParams

    monkeypatch.setattr(settings, "_current", Settings())
    before = process_default()
    seen: list[bool] = []
    invariant, runner = dispatch.invariant, engine_module.ModelRunner

    def spy(x):   # every projection and attention asks it: the switch the kernels read
        seen.append(current().deterministic)
        return invariant(x)

    def built(*args, **kwargs):
        seen.append(current().deterministic)
        return runner(*args, **kwargs)
    monkeypatch.setattr(dispatch, "invariant", spy)
    monkeypatch.setattr(engine_module, "ModelRunner", built)
    target = zoo("qwen3").target
    engines = {}
    for flag in (True, False):
        engines[flag] = _engine(target, deterministic=flag)
        assert seen == [flag] and engines[flag].settings.deterministic is flag
        seen.clear()
    warm_up(engines[True])
    assert seen and set(seen) == {True}
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outs = {flag: eng.add_request([1, 2, 3], params) for flag, eng in engines.items()}
    steps = 0
    while any(e.has_unfinished() for e in engines.values()):
        for flag, eng in engines.items():
            seen.clear()
            eng.step()
            assert set(seen) <= {flag}
            steps += bool(seen)
    assert steps >= 8   # every step of each ran a forward
    # on the CPU without Triton the mode changes no kernel: both decode alike
    assert outs[True].output_ids == outs[False].output_ids and len(outs[True].output_ids) == 5
    assert process_default() is before and current() is before


def test_a_follower_and_the_engine_thread_run_under_the_engines_settings(monkeypatch):
    """A tensor-parallel follower's commands and the server's engine thread (each with a
    stand-in engine) run under the engine's settings, whatever their thread's scope."""
    from drafttree.engine import launch
    from drafttree.parallel.commands import SHUTDOWN
    from drafttree.server.worker import EngineWorker

    monkeypatch.setattr(settings, "_current", Settings())
    own = Settings(attn_kernel=False, deterministic=True)
    seen: list[Settings] = []

    class Runner:
        def collect_phase_times(self) -> None:
            pass

        def probe(self) -> None:
            seen.append(current())

    class Channel:
        def __init__(self, tp) -> None:
            self.commands = iter([("probe", (), {}), ("probe", (), {}), (SHUTDOWN, (), {})])

        def receive(self):
            return next(self.commands)
    monkeypatch.setattr(launch, "CommandChannel", Channel)
    monkeypatch.setattr(launch, "COMMANDS", {"probe"})
    monkeypatch.setattr(launch, "close_group", lambda *tp: None)
    follower = SimpleNamespace(tp=SimpleNamespace(leader=False, rank=1), runner=Runner(), settings=own)
    with using(gemm=False):
        assert launch.follow(follower) == 0
        assert current() == Settings(gemm=False)
    assert seen == [own, own]

    seen.clear()

    class Stepping:
        settings, failure, running, waiting, graphs_pending = own, None, [], [], 0
        left = 2

        def has_unfinished(self) -> bool:
            return self.left > 0

        def step(self) -> list:
            self.left -= 1
            seen.append(current())
            return []
    worker = EngineWorker(Stepping())
    worker.start()
    deadline = time.monotonic() + 10
    while len(seen) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    worker.stop()
    assert seen == [own, own] and current() == Settings()
