"""Tensor-parallel launches end to end on the CPU: the server with the rank it spawns (its answer; a
rank that loses rank 0 exits; the server ends when a rank is lost), torchrun's processes joining
as ranks (the command line), and the phase benchmark's CPU path at TP=2.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from drafttree import LLM, SamplingParams
from drafttree.parallel.group import free_port
from tests.tiny import make_drafter, make_target, write_tokenizer

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "ab!cd"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """A tiny Qwen3 target with a character-level tokenizer (text prompts), and a drafter beside it."""
    root = tmp_path_factory.mktemp("tp-launch")
    target = write_tokenizer(make_target(root / "target", "qwen3", vocab=97, scale=3.0), 97)
    make_drafter(root / "drafter", target, block_size=4)
    return target


@pytest.fixture(scope="module")
def tp1_text(model) -> str:
    llm = LLM(model=str(model), device="cpu", dtype="float32", max_num_seqs=2, max_model_len=64)
    return llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8))[0].text


def serve(model: Path, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "drafttree.cli", "serve", "--model", str(model), "-tp", "2", "--device", "cpu",
           "--dtype", "float32", "--max-model-len", "64", "--max-num-seqs", "2", "--port", str(port)]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_ready(server: subprocess.Popen, port: int, limit_s: float = 120.0) -> None:
    import httpx
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        assert server.poll() is None, server.communicate()[1][-3000:]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("the server did not come up")


def spawned_rank(parent: int) -> int:
    """The pid of the rank a process spawned (not multiprocessing's resource tracker)."""
    out = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout.split()
    ranks = [int(p) for p in out if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(ranks) == 1, out
    return ranks[0]


def gone(pid: int, limit_s: float) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]:
            return True
        time.sleep(0.2)
    return False


def test_the_server_answers_at_tp2_and_its_rank_exits_with_it(model, tp1_text):
    import httpx
    port = free_port()
    server = serve(model, port)
    try:
        wait_ready(server, port)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == tp1_text
        rank = spawned_rank(server.pid)
        server.kill()   # rank 0 lost: its follower stops on its own
        assert gone(rank, 30), "the rank outlived rank 0"
    finally:
        server.kill()
        server.communicate()


def test_the_server_ends_when_a_rank_is_lost(model):
    """The engine thread sees the loss (idle, within a second), fails what is live and calls
    on_failure, which `run_server` turns into uvicorn's exit and `drafttree: error: ...`."""
    import threading

    from starlette.testclient import TestClient

    from drafttree.server.app import create_app
    llm = LLM(model=str(model), device="cpu", dtype="float32", max_num_seqs=2, max_model_len=64,
              tensor_parallel_size=2)
    failed = threading.Event()
    try:
        app = create_app(llm.engine, "tiny", on_failure=failed.set)
        with TestClient(app) as client:
            app.state.boot.join(60)   # the warm-up's requests ran on both ranks
            assert client.get("/ready").status_code == 200
            worker = llm.engine.ranks.workers[0]
            os.kill(worker.pid, signal.SIGKILL)
            assert failed.wait(15), "the server kept running without a rank"
            lost = f"pid {worker.pid}) was killed by signal 9"
            health = client.get("/health")
            assert health.status_code == 503 and lost in health.text
            assert client.get("/ready").status_code == 503
            assert lost in app.state.boot.fatal
    finally:
        llm.shutdown()


def test_torchrun_processes_join_as_ranks(model, tp1_text):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "drafttree.cli", "generate", PROMPT, "--model", str(model), "--tensor-parallel-size", "2",
           "--device", "cpu", "--dtype", "float32", "--max-model-len", "64", "--max-num-seqs", "2",
           "--max-tokens", "8", "--raw", "--json"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]   # rank 0 alone prints
    assert json.loads(line)["text"] == tp1_text


def test_phase_benchmark_at_tp2_on_cpu(model, capsys):
    from drafttree.bench import phases
    assert phases.main(["--model", str(model), "--draft-model", str(model.parent / "drafter"), "--device", "cpu",
                        "--dtype", "float32", "--spec", "ddtree", "--budget", "4", "--prompt-len", "8", "--iters",
                        "2", "--max-model-len", "64", "-tp", "2"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["tensor_parallel_size"] == 2
    # per layer an all-reduce after attention and one after the MLP; the embedding's; the head's gather
    assert res["decode_collectives"] == {"all_reduce 1x1x32 float32": 2 * 3 + 1, "all_gather 1x49 float32": 1}
    ms = res["eager_ms"]
    assert 0 < ms["collectives_share"] and ms["round_in_decode_steps"] > 0
