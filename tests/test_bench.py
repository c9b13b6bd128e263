"""drafttree bench end to end on a tiny pair (CPU): results.json and plots."""
from __future__ import annotations

import json

import pytest

from drafttree.bench.cli import main
from tests.tiny import make_drafter, make_target


def test_bench_writes_results_and_plots(tmp_path):
    t = make_target(tmp_path / "t", "llama", vocab=9, layers=2, scale=3.0)
    d = make_drafter(tmp_path / "d", t, block_size=4, target_layer_ids=[0])
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt_ids": [i % 7 + 1, 2, 3]}) for i in range(3)))
    out = tmp_path / "out"
    rc = main(["--model", str(t), "--draft-model", str(d), "--prompts", str(prompts), "--num-prompts", "3",
               "--max-tokens", "12", "--budgets", "auto,2,8", "--temperatures", "0,1", "--device", "cpu",
               "--dtype", "float32", "--max-model-len", "64", "--host-profile", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    runs = {(r["method"], r["budget"], r["temperature"]) for r in res["results"]}
    assert runs == {(m, b, T) for T in (0.0, 1.0) for m, b in (("ar", None), ("dflash", None), ("dflash", "auto"),
                                                                ("ddtree", "auto"), ("ddtree", 2), ("ddtree", 8))}
    ar = {r["temperature"]: r for r in res["results"] if r["method"] == "ar"}
    for r in res["results"]:
        assert r["output_tokens"] == 36 and r["tokens_per_s"] == pytest.approx(36 / r["wall_s"])
        # against AR's throughput at the same temperature, from the same results
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / ar[r["temperature"]]["tokens_per_s"])
        hist = {int(tau): n for tau, n in r["tau_histogram"].items()}
        accepted = sum(tau * n for tau, n in hist.items())
        assert sum(hist.values()) == r["rounds"] and r["tau_mean"] == pytest.approx(accepted / r["rounds"])
        # each of the 3 requests: one token from its prefill, then its rounds' (the last may run past 12)
        assert 36 <= 3 + accepted <= 3 * (12 - 1 + 4)
        assert 0 < r["ttft_ms"] < 1e3 * r["wall_s"] / 3 and r["decode_tokens_per_s"] > 0
        # on CPU the phase timer counts host time inside each round, so within the round's wall
        assert 0 < r["round_gpu_ms"] <= r["round_ms"] < 1e3 * r["wall_s"]
        profile = out / f"host_profile_{r['method']}{r['budget'] or ''}_T{r['temperature']:g}.txt"
        assert "ncalls" in profile.read_text()
        # batch 1: one request per round; the rounds by the budget they ran at
        assert sum(r["budget_histogram"].values()) == r["rounds"]
        if r["budget"] != "auto":
            fixed = {"ar": "0", "dflash": "3"}.get(r["method"], str(r["budget"]))
            assert set(r["budget_histogram"]) == {fixed}, r
        if r["method"] == "ar":
            assert r["tau_mean"] == 1.0 and r["speedup"] == 1.0
        # auto rows: what the choice weighed — every allowed budget priced, and at T = 0 (drafted
        # rounds read) the calibration and expected τ of each speculative one
        if r["budget"] == "auto":
            c = r["budget_choice"]
            assert "0" in c["round_ms"] and min(c["round_ms"].values()) > 0
            if r["temperature"] == 0:
                assert set(c["calibration"]) == set(c["expected_tau"]) == set(c["round_ms"]) - {"0"} != set()
                assert all(r >= 0 for r in c["calibration"].values())
                assert all(t >= 1.0 for t in c["expected_tau"].values())
        else:
            assert "budget_choice" not in r
        # fp32: every greedy speculative output is plain decoding's; sampled runs are not compared
        assert r.get("same_as_ar") == (1.0 if r["temperature"] == 0 else None)
        # the engine's start-up, stage by stage, in the record
        st = r["startup"]
        assert {"load weights", "tokenizer"} <= set(st["stages"]) and st["total_s"] >= st["stages"]["load weights"]
        assert ("cost model" in st["stages"]) == (r["budget"] == "auto")
    assert max(r["tau_mean"] for r in res["results"] if r["method"] == "ddtree") > 1.0
    env = res["meta"]["environment"]   # what the figures depend on besides the command
    assert env["torch"] and set(env["kernels"]) == {"attention", "one_token_projections", "few_row_projections",
                                                  "dependent_launch"}
    assert (out / "budget_sweep.png").stat().st_size > 0 and (out / "acceptance_histogram.png").stat().st_size > 0
    merged = tmp_path / "merged"
    halves = []
    for T in (0.0, 1.0):
        half = {"meta": res["meta"], "results": [r for r in res["results"] if r["temperature"] == T]}
        halves.append(tmp_path / f"half{T}.json")
        halves[-1].write_text(json.dumps(half))
    assert main(["--from-results", *map(str, halves), "--out", str(merged)]) == 0
    again = json.loads((merged / "results.json").read_text())["results"]
    key = lambda r: (r["method"], str(r["budget"]), r["temperature"])  # noqa: E731
    assert {key(r): r["speedup"] for r in again} == {key(r): r["speedup"] for r in res["results"]}
    assert len(again) == len(res["results"])


def test_top_k_and_top_p_reach_every_request(tmp_path):
    """`--top-k 1` at T = 1 samples from the best token alone: the greedy run's tokens."""
    from drafttree.bench.cli import build_parser, make_llm, run_one
    t = make_target(tmp_path / "t", "llama", vocab=9, layers=2, scale=3.0)
    d = make_drafter(tmp_path / "d", t, block_size=4, target_layer_ids=[0])
    a = build_parser().parse_args(["--model", str(t), "--draft-model", str(d), "--device", "cpu", "--dtype", "float32",
                                   "--max-model-len", "64", "--max-tokens", "10", "--top-k", "1", "--top-p", "0.5",
                                   "--out", str(tmp_path)])
    prompts = [[i % 7 + 1, 2, 3] for i in range(3)]

    class Bar:
        def update(self, n: int) -> None:
            pass
    for method, budget in (("ar", None), ("ddtree", 4)):
        llm = make_llm(a, method, budget)
        greedy, want = run_one(a, llm, method, budget, prompts, 0.0, Bar())
        sampled, got = run_one(a, llm, method, budget, prompts, 1.0, Bar())
        assert got == want and (sampled["top_k"], sampled["top_p"]) == (1, 0.5)


def test_prompt_files_keep_line_separators_inside_prompts(tmp_path):
    """A JSONL written with ensure_ascii=False keeps U+2028 raw inside a prompt: one record, not two
    halves; a line that is not a prompt record names its file and line."""
    from drafttree.bench.prompts import load_prompts
    f = tmp_path / "p.jsonl"
    rows = [{"prompt": "first\u2028still first\x1cand \u00e9"}, {"prompt_ids": [1, 2, 3]}]
    f.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n\n", encoding="utf-8")
    assert load_prompts(str(f), 10) == [rows[0]["prompt"], [1, 2, 3]]
    assert load_prompts(str(f), 1) == [rows[0]["prompt"]]
    f.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"p\.jsonl:2: not a prompt record"):
        load_prompts(str(f), 10)


def test_budget_schedule_goes_where_it_applies():
    from drafttree.phases import schedule_for
    assert schedule_for("ddtree", "8:16,32:0") == "8:16,32:0" and schedule_for("ddtree", "auto") == "auto"
    assert schedule_for("dflash", "16:0") == "16:0"
    # a given schedule DFlash cannot take means no schedule, not the drafter config's
    assert schedule_for("dflash", "8:16,32:0") == "none" and schedule_for("dflash", "auto") == "auto"
    assert schedule_for("dflash", " none ") == "none"
    assert schedule_for("ar", "16:0") is None and schedule_for("dflash", None) is None


@pytest.mark.parametrize("shape", ["qwen3-8b", "smollm2-135m"])
def test_projection_shapes_are_the_layers(shape):
    """The kernel benchmarks time the weights a decoder layer of the shape really has."""
    import torch

    from drafttree.models.random_shapes import SHAPES, projections
    from drafttree.models.decoder import DecoderLayer
    cfg = SHAPES[shape][0]
    with torch.device("meta"):
        layer = DecoderLayer(cfg)
    have = {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj, "gate_up": layer.mlp.gate_up_proj,
            "down": layer.mlp.down_proj}
    assert projections(cfg) == {name: tuple(m.weight.shape) for name, m in have.items()}


def test_one_engine_runs_every_batch_size_and_prompt_set(tmp_path):
    """`--batch 1,3` and two prompt sets: each run is compared with plain decoding of its own
    prompts, batch size and temperature, and with plain decoding at batch 1. `--waves 2` makes
    the batch-3 cells decode 6 requests (the 4 prompts, then the first 2 again)."""
    t = make_target(tmp_path / "t", "qwen3", vocab=11, layers=2, scale=3.0)
    d = make_drafter(tmp_path / "d", t, block_size=4, target_layer_ids=[0])
    sets = []
    for k in range(2):
        sets.append(tmp_path / f"set{k}.jsonl")
        sets[-1].write_text("\n".join(json.dumps({"prompt_ids": [i % 7 + 1 + k, 2, 3 + k]}) for i in range(4)))
    out = tmp_path / "out"
    assert main(["--model", str(t), "--draft-model", str(d), "--prompts", ",".join(map(str, sets)),
                 "--num-prompts", "4", "--max-tokens", "9", "--methods", "ar,ddtree", "--budgets", "auto,4",
                 "--temperatures", "0", "--batch", "1,3", "--waves", "2", "--device", "cpu",
                 "--dtype", "float32", "--max-model-len", "64", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    cells = {(r["prompts"], r["batch"]) for r in res["results"]}
    assert cells == {(str(s), b) for s in sets for b in (1, 3)} and res["meta"]["batch"] == [1, 3]
    for r in res["results"]:
        ar = next(x for x in res["results"] if x["method"] == "ar" and (x["prompts"], x["batch"]) == (r["prompts"], r["batch"]))
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / ar["tokens_per_s"])
        assert r["output_tokens"] == 9 * (4 if r["batch"] == 1 else 6)
        assert r["same_as_ar"] == 1.0 and r["same_as_ar_alone"] == 1.0
    for s in sets:
        for b in (1, 3):
            assert (out / f"budget_sweep_{s.stem}_b{b}.png").stat().st_size > 0
    with pytest.raises(ValueError, match="positive"):
        main(["--batch", "0", "--out", str(tmp_path / "bad")])
    with pytest.raises(ValueError, match="waves"):
        main(["--waves", "-1", "--out", str(tmp_path / "bad")])


def test_repeats_alternate_the_methods_and_summarise(tmp_path, monkeypatch):
    """--repeats 3: every engine started once, each cell run three times with the methods' order
    reversed every other repeat; each repeat's speedup against its own plain run, and a summary
    per method with the median and range."""
    from drafttree.bench import cli
    t = make_target(tmp_path / "t", "llama", vocab=9, layers=2, scale=3.0)
    d = make_drafter(tmp_path / "d", t, block_size=4, target_layer_ids=[0])
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt_ids": [i % 7 + 1, 2, 3]}) for i in range(2)))
    order, started, run_one = [], [], cli.run_one
    monkeypatch.setattr(cli, "run_one", lambda a, llm, m, *rest, **kw: order.append(m) or run_one(a, llm, m, *rest, **kw))
    make_llm = cli.make_llm
    monkeypatch.setattr(cli, "make_llm", lambda a, m, b: started.append(m) or make_llm(a, m, b))
    out = tmp_path / "out"
    args = ["--model", str(t), "--draft-model", str(d), "--prompts", str(prompts), "--num-prompts", "2",
            "--max-tokens", "6", "--methods", "ar,ddtree", "--budgets", "auto", "--temperatures", "0",
            "--device", "cpu", "--dtype", "float32", "--max-model-len", "64", "--out", str(out)]
    assert main(args + ["--repeats", "3"]) == 0
    assert started == ["ar", "ddtree"] and order == ["ar", "ddtree", "ddtree", "ar", "ar", "ddtree"]
    res = json.loads((out / "results.json").read_text())
    assert sorted((r["method"], r["repeat"]) for r in res["results"]) == [(m, k) for m in ("ar", "ddtree")
                                                                           for k in range(3)]
    for r in res["results"]:
        ar = next(x for x in res["results"] if x["method"] == "ar" and x["repeat"] == r["repeat"])
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / ar["tokens_per_s"]) and r["same_as_ar"] == 1.0
    auto = next(s for s in res["summary"] if s["method"] == "ddtree")
    speedups = sorted(r["speedup"] for r in res["results"] if r["method"] == "ddtree")
    assert auto["repeats"] == 3 and auto["speedup"] == pytest.approx(speedups[1])
    assert auto["speedup_range"] == pytest.approx([speedups[0], speedups[2]])
    with pytest.raises(ValueError, match="--repeats must be >= 1"):
        main(args + ["--repeats", "0"])
