"""The commands a user types, on a tiny random pair with a character-level tokenizer (CPU):
`drafttree generate --json`, `drafttree graphs` and `python -m drafttree.bench.phases`."""
from __future__ import annotations

import json

import pytest

from drafttree.cli import main
from tests.tiny import make_drafter, make_target, write_tokenizer


VOCAB = 97
BLOCK = 4
PROMPT = "Hello"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    target = make_target(root / "target", "qwen3", vocab=VOCAB, layers=2, scale=3.0)
    write_tokenizer(target, VOCAB)
    return target, make_drafter(root / "drafter", target, block_size=BLOCK)


def run(capsys: pytest.CaptureFixture, *argv: str) -> str:
    capsys.readouterr()
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def test_generate_json(pair, capsys):
    """One JSON object: the requested number of tokens, plain decoding's (lossless), and round
    counts that add up to them."""
    t, d = pair
    common = ["--model", str(t), "--device", "cpu", "--dtype", "float32", "--max-model-len", "64",
              "--max-tokens", str(MAX_TOKENS), "--json"]
    got = json.loads(run(capsys, "generate", PROMPT, *common, "--draft-model", str(d), "--spec", "ddtree",
                         "--budget", "8"))
    plain = json.loads(run(capsys, "generate", PROMPT, *common, "--spec", "none"))
    assert (got["spec"], got["block_size"], got["budget"]) == ("ddtree", BLOCK, 8)
    assert got["prompt_tokens"] == len(PROMPT)   # one token a character, no chat template
    assert got["completion_tokens"] == len(got["token_ids"]) == MAX_TOKENS and got["finish_reason"] == "length"
    assert got["token_ids"] == plain["token_ids"] and got["text"] == plain["text"] and got["text"]
    hist = {int(tau): n for tau, n in got["accept_histogram"].items()}
    accepted = sum(tau * n for tau, n in hist.items())
    assert sum(hist.values()) == got["rounds"] and got["mean_accept_length"] == round(accepted / got["rounds"], 3)
    # the prefill commits one token, each round tau; the last round may run past max_tokens
    assert MAX_TOKENS <= 1 + accepted <= MAX_TOKENS - 1 + BLOCK
    assert 0 < got["ttft_s"] <= got["total_s"]


@pytest.mark.parametrize("block_size,budget", [(8, 32), (4, 5)])
def test_graphs_prints_each_phase_width(pair, capsys, block_size, budget):
    """Weight-free: the DDTree plan drafts block_size wide and verifies budget + 1 nodes."""
    t, d = pair
    out = run(capsys, "graphs", "--model", str(t), "--draft-model", str(d), "--spec", "ddtree",
              "--block-size", str(block_size), "--budget", str(budget))
    assert f"draft={block_size}, verify={budget + 1}" in out
    widths = {cols[0]: int(cols[1]) for cols in map(str.split, out.splitlines())
              if len(cols) > 1 and cols[0] in ("draft", "verify")}
    assert widths == {"draft": block_size, "verify": budget + 1}


def test_bench_phases(pair, capsys, tmp_path):
    """`python -m drafttree.bench.phases` (its main, in this process): every phase of a DDTree
    round timed on the tiny pair, with the widths and the settings; stdout is what --out holds."""
    from drafttree.bench import phases

    t, d = pair
    out = tmp_path / "phases.json"
    capsys.readouterr()
    assert phases.main(["--model", str(t), "--draft-model", str(d), "--device", "cpu", "--dtype", "float32",
                        "--spec", "ddtree", "--budget", "8", "--prompt-len", "8", "--max-model-len", "64",
                        "--iters", "1", "--tree-budgets", "", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == res
    assert (res["spec"], res["block_size"], res["budget"], res["batch"]) == ("ddtree", BLOCK, 8, 1)
    assert res["widths"] == {"context": BLOCK, "decode": 1, "draft": BLOCK, "verify": 9}
    ms = res["eager_ms"]
    assert {"decode", "context", "draft", "tree_build", "verify", "accept_commit", "round"} <= set(ms)
    assert ms["round_in_decode_steps"] == pytest.approx(ms["round"] / ms["decode"])
    assert res["graph_ms"] == {} and "settings" in res["environment"]   # no graphs on CPU


def test_serve_passes_the_request_size_limit(monkeypatch):
    """`drafttree serve --max-request-bytes N` reaches the server's limits; the default is 4 MiB."""
    from drafttree.server import app

    seen = []
    monkeypatch.setattr(app, "run_server", lambda cfg, host, port, name, limits: seen.append((port, limits)))
    assert main(["serve", "--port", "9", "--max-request-bytes", "1000"]) == 0
    assert main(["serve"]) == 0
    assert [(p, lim.max_request_bytes) for p, lim in seen] == [(9, 1000), (8000, 4 << 20)]
