"""The commands a user types, on a tiny random pair with a character-level tokenizer (CPU):
`drafttree generate --json`, `drafttree graphs` and `python -m drafttree.bench.phases`."""
from __future__ import annotations

import json

import pytest

from drafttree.cli import main
from drafttree.phases import CONTEXT_ROUNDS
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


def test_generate_json_reports_a_reasoning_models_two_parts(tmp_path, capsys):
    """With --reasoning-parser the JSON holds the reply's reasoning and content apart; a model
    whose tokenizer cannot write the markers is refused before its weights load."""
    target = make_target(tmp_path / "target", "qwen3", vocab=VOCAB, layers=2, scale=3.0)
    write_tokenizer(target, VOCAB, added=("<think>", "</think>"))
    common = ["--model", str(target), "--device", "cpu", "--dtype", "float32", "--max-model-len", "64",
              "--max-tokens", str(MAX_TOKENS), "--json", "--spec", "none", "--raw", "--reasoning-parser", "qwen3"]
    got = json.loads(run(capsys, "generate", "Hi <think>", *common))
    reasoning, sep, content = got["text"].partition("</think>")
    assert (got["reasoning"], got["content"]) == (reasoning.strip(), content.lstrip() if sep else "")
    free = json.loads(run(capsys, "generate", "Hi", *common))   # the prompt left it free: the output did not open it
    assert free["reasoning"] is None and free["content"] == free["text"]
    write_tokenizer(target, VOCAB)
    assert main(["generate", "Hi", *common]) == 2
    assert "reasoning parser qwen3: the model's tokenizer spells '<think>' as 7 tokens" in capsys.readouterr().err


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
    # the context write holds CONTEXT_ROUNDS verifies' commits (max_commit = BLOCK here)
    assert res["widths"] == {"context": CONTEXT_ROUNDS * BLOCK, "decode": 1, "draft": BLOCK, "verify": 9}
    ms = res["eager_ms"]
    assert {"decode", "context", "draft", "tree_build", "verify", "accept_commit", "round"} <= set(ms)
    assert ms["round_in_decode_steps"] == pytest.approx(ms["round"] / ms["decode"])
    assert res["graph_ms"] == {} and "settings" in res["environment"]   # no graphs on CPU


def test_serve_passes_the_request_size_limit_the_api_key_and_the_origins(monkeypatch):
    """`drafttree serve --max-request-bytes N --api-key K --allowed-origins O,...` reach the
    server's limits; the default size is 4 MiB, the key $DRAFTTREE_API_KEY's, else none, the
    origins any (vLLM's default)."""
    from drafttree.server import app

    seen = []
    monkeypatch.setattr(app, "run_server", lambda cfg, host, port, name, limits: seen.append((port, limits)))
    monkeypatch.delenv("DRAFTTREE_API_KEY", raising=False)
    assert main(["serve", "--port", "9", "--max-request-bytes", "1000", "--api-key", "k1",
                 "--allowed-origins", "https://a.example, https://b.example"]) == 0
    assert main(["serve"]) == 0
    monkeypatch.setenv("DRAFTTREE_API_KEY", "k2")
    assert main(["serve", "--allowed-origins", ""]) == 0
    assert [(p, lim.max_request_bytes, lim.api_key, lim.allowed_origins) for p, lim in seen] == \
        [(9, 1000, "k1", ("https://a.example", "https://b.example")), (8000, 4 << 20, None, ("*",)),
         (8000, 4 << 20, "k2", ())]


def _engine_actions(parser) -> dict[str, object]:
    """The actions of `parser` that set an EngineConfig field, by field name."""
    from dataclasses import fields

    from drafttree.engine.config import EngineConfig
    names = {f.name for f in fields(EngineConfig)}
    return {a.dest: a for a in parser._actions if a.dest in names}


def _generate_parser():
    from drafttree.cli import build_parser
    sub = next(a for a in build_parser()._actions if a.dest == "cmd")
    return sub.choices["generate"]


def test_every_engine_field_has_a_flag_with_help():
    """`drafttree generate` has a flag for every EngineConfig field but the timing-only ones in
    NOT_SERVED (the benchmarks take those), and every engine flag of every command says what it does."""
    from dataclasses import fields

    from drafttree.bench import cli as bench_cli, phases
    from drafttree.engine.cli_args import NOT_SERVED
    from drafttree.engine.config import EngineConfig
    everything = {f.name for f in fields(EngineConfig)}
    # a field whose `_opt(...)` lost its metadata (a stray comma makes its default a tuple)
    assert not [f.name for f in fields(EngineConfig) if not f.metadata.get("help")]
    generate = _engine_actions(_generate_parser())
    assert NOT_SERVED == ("random_weights", "random_drafter")
    assert set(generate) == everything - set(NOT_SERVED)
    parsers = {"generate": generate, "bench": _engine_actions(bench_cli.build_parser()),
               "phases": _engine_actions(phases.build_parser())}
    assert set(NOT_SERVED) <= set(parsers["bench"]) & set(parsers["phases"])
    for command, actions in parsers.items():
        for name, action in actions.items():
            meaning = action.help.rsplit(" (default: ", 1)[0]
            assert meaning.strip() and "(default: " in action.help, (command, name, action.help)


def test_every_flag_spelling_still_parses_and_reaches_its_field():
    """The spellings the README, the tests and older command lines use, and a field of each kind:
    ints, floats, choices, the budget, a tuple, switches both ways; a flag not given keeps
    EngineConfig's default."""
    from dataclasses import replace

    from drafttree.cli import engine_config
    from drafttree.engine.config import EngineConfig
    p = _generate_parser()
    assert engine_config(p.parse_args(["hi"])) == EngineConfig(max_num_seqs=1)   # generate's one prompt: one row
    argv = ["hi", "--model", "m", "--draft-model", "d", "--spec", "ddtree", "--block-size", "8", "--budget", "16",
            "--budget-schedule", "8:4", "--no-speculate-sampled", "--dtype", "bf16", "--draft-quantization", "fp8",
            "--device", "cpu", "--max-num-seqs", "4", "--max-model-len", "128", "--kv-cache-memory-gb", "0.5",
            "--gpu-memory-utilization", "0.8", "--page-size", "32", "--no-prefix-caching", "--no-cuda-graphs",
            "--sampler-modes", "greedy,filtered", "--max-graph-len", "300", "--no-prefill-graphs",
            "--max-prefill-tokens", "512", "--prefill-chunk", "64", "--admit-min", "2", "--no-overlap", "-tp", "2",
            "--distributed-timeout", "9.5", "--deterministic"]
    want = EngineConfig(model="m", draft_model="d", spec="ddtree", block_size=8, budget=16, budget_schedule="8:4",
                        speculate_sampled=False, dtype="bf16", draft_quantization="fp8", device="cpu", max_num_seqs=4,
                        max_model_len=128, kv_cache_memory_gb=0.5, gpu_memory_utilization=0.8, page_size=32,
                        enable_prefix_caching=False, cuda_graphs=False, sampler_modes=("greedy", "filtered"),
                        max_graph_len=300, prefill_graphs=False, max_prefill_tokens=512, prefill_chunk=64, admit_min=2,
                        overlap=False, tensor_parallel_size=2, distributed_timeout_s=9.5, deterministic=True)
    assert engine_config(p.parse_args(argv)) == want
    on = ["hi", "--budget", "auto", "--speculate-sampled", "--cuda-graphs", "--prefill-graphs", "--overlap",
          "--prefix-caching", "--tensor-parallel-size", "3", "--no-deterministic"]
    assert engine_config(p.parse_args(on)) == replace(EngineConfig(max_num_seqs=1), budget="auto",
                                                      speculate_sampled=True, cuda_graphs=True, prefill_graphs=True,
                                                      overlap=True, tensor_parallel_size=3, deterministic=False)


def test_train_drafters_engine_flags():
    """`drafttree train-drafter` takes the engine's switches from the same fields, in its older
    spelling too (--kv-cache-gb)."""
    from drafttree.train.cli import build_parser, regen_config
    a = build_parser().parse_args(["regenerate", "--out", "o", "--no-cuda-graphs", "--kv-cache-gb", "3"])
    rc = regen_config(a)
    assert (rc.cuda_graphs, rc.kv_cache_memory_gb) == (False, 3.0)


@pytest.mark.parametrize("argv,says", [
    (["--budget", "0"], "argument --budget: budget must be >= 1 or 'auto'"),
    (["--budget", "many"], "argument --budget: budget must be 'auto' or a number of tree nodes, got 'many'"),
    (["--sampler-modes", "greedy,fast"], "argument --sampler-modes: ['fast']: choose from greedy, sample, filtered"),
    (["--dtype", "fp64"], "argument --dtype: invalid choice: 'fp64'"),
    (["--max-num-seqs", "2.5"], "argument --max-num-seqs: expected int, got '2.5'"),
    (["--spec", "medusa"], "argument --spec: invalid choice: 'medusa'"),
])
def test_a_bad_engine_flag_is_refused_naming_it(capsys, argv, says):
    with pytest.raises(SystemExit) as e:
        main(["generate", "hi", *argv])
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_an_empty_raw_prompt_is_refused_before_the_model_loads(capsys, monkeypatch):
    import drafttree.engine.launch as launch

    def never(*a, **k):
        raise AssertionError("the engine was started for an empty prompt")
    monkeypatch.setattr(launch, "start_engine", never)
    assert main(["generate", "", "--raw"]) == 2
    assert "the prompt is empty" in capsys.readouterr().err


def test_the_flags_choices_are_the_codes():
    """The choices EngineConfig's metadata lists are the names the code takes."""
    from drafttree.config import DTYPES
    from drafttree.engine import config
    from drafttree.models.quant import METHODS
    from drafttree.runner.cuda_graph import CAPTURED_MODES
    assert set(config.DTYPE_NAMES) == set(DTYPES) | {"auto"}
    assert config.DRAFT_QUANTIZATIONS == METHODS
    assert config.SAMPLER_MODE_NAMES == tuple(m.name.lower() for m in CAPTURED_MODES)
    assert config.GENERATION_CONFIGS == ("auto", "vllm")   # vLLM's --generation-config names
    from drafttree.server.tool_parsers import PARSERS
    from drafttree.structured.reasoning import FORMATS
    assert set(config.TOOL_CALL_PARSERS) == set(PARSERS) and set(config.REASONING_PARSERS) == set(FORMATS)


def test_the_benchmarks_defaults_and_fixed_fields():
    """The benchmarks' own defaults (a budget of 32 and 2048 tokens for the phases; speculation at
    T > 0 for bench) and the fields each run sets over the flags."""
    from drafttree.bench import cli as bench_cli, phases
    from drafttree.engine.cli_args import config_from_args
    from drafttree.engine.config import EngineConfig
    a = phases.build_parser().parse_args(["--random-weights", "qwen3-8b", "--random-drafter", "--deterministic"])
    assert config_from_args(a, max_num_seqs=1, cuda_graphs=False) == EngineConfig(
        spec="ddtree", budget=32, max_model_len=2048, max_num_seqs=1, cuda_graphs=False, random_weights="qwen3-8b",
        random_drafter=True, deterministic=True)
    b = bench_cli.build_parser().parse_args(["--no-cuda-graphs", "-tp", "2", "--prefill-chunk", "256"])
    assert config_from_args(b, spec="ddtree", budget=8, max_num_seqs=4) == EngineConfig(
        spec="ddtree", budget=8, max_num_seqs=4, speculate_sampled=True, max_model_len=2048, cuda_graphs=False,
        tensor_parallel_size=2, prefill_chunk=256)
    with pytest.raises(SystemExit):
        phases.main(["--budget", "auto"])
    with pytest.raises(SystemExit):   # each run sets its method: no --spec here
        bench_cli.build_parser().parse_args(["--spec", "none"])


def test_python_dash_m_runs_the_command():
    """`python -m drafttree` is the `drafttree` command (where the package runs from a tree that
    was not installed, the script is missing)."""
    import subprocess
    import sys
    from pathlib import Path

    r = subprocess.run([sys.executable, "-m", "drafttree", "cache", "--help"], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parent.parent, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "drafttree cache" in r.stdout


def test_the_command_speaks_before_the_engine_does(capsys, monkeypatch):
    """`drafttree generate` and `serve` say at once that they start, then every EVERY_S until the
    engine's first start-up line; the rest of the command line stays quiet until it has something
    to say."""
    import logging
    import time

    from drafttree import entry

    logger = logging.getLogger(entry.STARTUP_LOGGER)
    monkeypatch.setattr(logger, "handlers", [])   # (an earlier `generate`'s stderr handler, its stream gone)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        seen = entry.announce("generate", every_s=0.05)
        time.sleep(0.4)
        logger.info("start-up: convert 0.01 s")   # the engine's first line stops it
        assert seen.wait(1)
        time.sleep(0.2)
        lines = capsys.readouterr().err.splitlines()
        time.sleep(0.2)
        assert capsys.readouterr().err == ""
    finally:
        logger.setLevel(level)
    assert lines[0] == "drafttree: start-up: generate: importing torch and drafttree"
    assert len(lines) >= 3 and all(x.startswith("drafttree: start-up: starting (") and x.endswith("s so far") for x in lines[1:])
    assert not any(isinstance(h, entry._Seen) for h in logger.handlers)
    # help and the commands that start no engine say nothing of a start-up
    for argv in (["generate", "--help"], ["cache", "info"]):
        try:
            entry.main(argv)
        except SystemExit:
            pass
        assert "start-up" not in capsys.readouterr().err
