"""Tensor parallelism fails clearly and never hangs: a size that does not divide the heads, MLP rows
or experts is refused before any weight loads (or any rank starts), and a rank that dies or stops
answering ends the engine with a TensorParallelError that says which, within the group's timeout.
"""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from drafttree import LLM, SamplingParams
from drafttree.cli import main as cli_main
from drafttree.engine import engine as engine_module
from drafttree.engine import launch
from drafttree.parallel.group import TensorParallelError

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def tp_llm(pair, **kw) -> LLM:
    return LLM(model=str(pair.target), device="cpu", dtype="float32", max_num_seqs=2, max_model_len=64,
               tensor_parallel_size=2, **kw)


@pytest.fixture
def nothing_starts(monkeypatch):
    """Fail the test if a weight loads or a rank starts."""
    def loaded(*a, **k):
        raise AssertionError("weights were loaded")

    def spawned(*a, **k):
        raise AssertionError("ranks were started")
    monkeypatch.setattr(engine_module, "load_models", loaded)
    monkeypatch.setattr(launch, "spawn_ranks", spawned)


def test_bad_sizes_are_refused_before_anything_loads(zoo, nothing_starts):
    pair = zoo("llama")   # 4 heads, 2 KV heads, 64 MLP rows
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        LLM(model=str(pair.target), device="cpu", tensor_parallel_size=0)
    with pytest.raises(ValueError, match="does not divide the 4 attention heads.*takes sizes 1, 2, 4"):
        LLM(model=str(pair.target), device="cpu", tensor_parallel_size=3)
    if torch.cuda.device_count() < 4:
        with pytest.raises(ValueError, match=f"needs 4 GPUs on this host, which has {torch.cuda.device_count()}"):
            LLM(model=str(pair.target), device="cuda", tensor_parallel_size=4)


def test_the_command_line_refuses_a_bad_size(zoo, nothing_starts, capsys):
    pair = zoo("llama")
    assert cli_main(["generate", "x", "--model", str(pair.target), "--device", "cpu", "-tp", "3"]) == 2
    assert "tensor_parallel_size 3 does not divide the 4 attention heads" in capsys.readouterr().err


@pytest.mark.parametrize("shape,changes,world,match", [
    ("qwen3_moe", dict(num_experts=6), 4, "tensor_parallel_size 4 does not divide the 6 routed experts; "
                                          "this model takes sizes 1, 2"),
    ("deepseek_v3", dict(num_attention_heads=6), 4, "tensor_parallel_size 4 does not divide the 6 attention heads; "
                                                    "this model takes sizes 1, 2"),
], ids=["experts", "mla-heads"])
def test_moe_and_mla_sizes_that_do_not_divide_are_refused_before_anything_loads(
        tmp_path, nothing_starts, monkeypatch, capsys, shape, changes, world, match):
    import uvicorn

    from tests.moe_tiny import make_moe_target
    target = str(make_moe_target(tmp_path / shape, shape, **changes))
    with pytest.raises(ValueError, match=match):
        LLM(model=target, device="cpu", tensor_parallel_size=world)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: pytest.fail("the server listened"))
    for cmd in (["graphs"], ["generate", "x"], ["serve"]):
        assert cli_main([*cmd, "--model", target, "--device", "cpu", "-tp", str(world)]) == 2
        assert match in capsys.readouterr().err


@pytest.mark.parametrize("shape,match", [
    ("qwen3-30b-a3b@2", "tensor_parallel_size 3 does not divide the 128 routed experts; this model takes sizes 1, 2, 4"),
    ("kimi-k2@2", "tensor_parallel_size 3 does not divide the 64 attention heads and the shared experts' 2048 "
                  "intermediate rows"),
], ids=["qwen3-30b-a3b", "kimi-k2"])
def test_moe_and_mla_random_shapes_refuse_sizes_that_do_not_divide(nothing_starts, shape, match):
    with pytest.raises(ValueError, match=match):
        LLM(random_weights=shape, device="cpu", tensor_parallel_size=3)


def test_a_rank_lost_in_a_step_stops_the_engine(zoo):
    pair = zoo("llama")
    llm = tp_llm(pair)
    try:
        worker = llm.engine.ranks.workers[0]
        run_round = llm.engine.runner.run_round

        def lose_rank_then_run(*args, **kwargs):   # the rank dies as rank 0 starts a round
            os.kill(worker.pid, signal.SIGKILL)
            worker.join(10)
            return run_round(*args, **kwargs)
        llm.engine.runner.run_round = lose_rank_then_run
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match=f"rank 1 \\(pid {worker.pid}\\) was killed by signal 9.*"
                                                      "the engine stopped"):
            llm.generate([[1, 2, 3]], PARAMS)
        assert time.monotonic() - t0 < 20
        with pytest.raises(TensorParallelError, match=f"rank 1 \\(pid {worker.pid}\\) was killed by signal 9"):
            llm.generate([[1, 2, 3]], PARAMS)   # and every step after it says why
    finally:
        llm.shutdown()


def test_a_rank_lost_while_idle_is_named_at_the_next_step(zoo):
    llm = tp_llm(zoo("llama"))
    try:
        worker = llm.engine.ranks.workers[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        deadline = time.monotonic() + 5
        while llm.engine.failure is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(TensorParallelError, match=f"rank 1 \\(pid {worker.pid}\\) was killed by signal 9"):
            llm.generate([[1, 2, 3]], PARAMS)
    finally:
        llm.shutdown()


def test_a_stalled_rank_times_out(zoo):
    llm = tp_llm(zoo("llama"), distributed_timeout_s=5.0)
    pid = llm.engine.ranks.workers[0].pid
    os.kill(pid, signal.SIGSTOP)   # alive, answering nothing
    try:
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match="(?i)timed out"):
            llm.generate([[1, 2, 3]], PARAMS)
        assert time.monotonic() - t0 < 25
    finally:
        os.kill(pid, signal.SIGKILL)
        os.kill(pid, signal.SIGCONT)
        llm.shutdown()


def test_a_script_without_the_main_guard_fails_at_once_and_says_why(zoo, tmp_path):
    """A script that builds a tensor-parallel engine at its top level: each spawned rank imports
    it again and dies in multiprocessing's bootstrapping; rank 0 says so within seconds instead of
    waiting out the rendezvous (minutes)."""
    import subprocess
    import sys
    from pathlib import Path

    pair = zoo("llama")
    script = tmp_path / "unguarded.py"
    script.write_text(f"from drafttree import LLM\nLLM(model={str(pair.target)!r}, device='cpu', dtype='float32', "
                      "tensor_parallel_size=2)\nprint('built')\n")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240,
                       cwd=Path(__file__).resolve().parent.parent)
    assert r.returncode != 0 and "built" not in r.stdout
    assert "rank 1 exited" in r.stderr and 'if __name__ == "__main__":' in r.stderr
    assert time.monotonic() - t0 < 120


BUILD_SCRIPT = '''import sys, time
from drafttree.engine import engine as E
def lost_rank(*a, **k):
    raise MemoryError("rank 1 ran out of memory reading its shard")
def stuck(*a, **k):
    time.sleep(600)   # as rank 0 waits in an NCCL collective for a rank that is gone
if __name__ == "__mp_main__":   # a spawned rank imports this script under that name
    E.load_models = lost_rank
if __name__ == "__main__":
    from drafttree import LLM
    if sys.argv[2] == "stuck":
        E.load_models = stuck
    try:
        LLM(model=sys.argv[1], device="cpu", dtype="float32", tensor_parallel_size=2)
    except Exception as e:
        print(f"raised {type(e).__name__}: {e}")
'''


@pytest.mark.parametrize("rank0", ["fails", "stuck"])
def test_a_rank_lost_while_the_engines_are_built_is_named_at_once(zoo, tmp_path, rank0):
    """Rank 1 dies building its engine: where rank 0's collective fails (gloo) the build raises
    TensorParallelError naming the rank; where it would wait out the group's timeout (NCCL; here
    rank 0 sleeps) the process exits within GRACE_S saying which rank was lost."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "build.py"
    script.write_text(BUILD_SCRIPT)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(script), str(zoo("llama").target), rank0], capture_output=True,
                       text=True, timeout=240, cwd=Path(__file__).resolve().parent.parent)
    assert "rank 1 ran out of memory" in r.stderr
    if rank0 == "fails":
        assert r.returncode == 0, r.stderr[-2000:]
        assert "raised TensorParallelError: tensor-parallel rank 1" in r.stdout
        assert "exited with code 1 while the engines were being built" in r.stdout
    else:
        assert r.returncode == 1 and "raised" not in r.stdout
        assert "rank 1" in r.stderr and "while the engines were being built, and rank 0 waits" in r.stderr
    assert time.monotonic() - t0 < launch.GRACE_S + 60
