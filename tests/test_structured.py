"""Structured output on tiny random models (CPU, fp32): every constrained output of DFlash and
DDTree equals plain constrained decoding's (`spec none`) token for token, greedy and seeded, in
batches mixing constrained and free requests; plain constrained decoding equals an independent
masked greedy decode of the same model; the host's draft trees hold only tokens the grammar
allows along their paths; constraints the grammar engine cannot honour are refused by name."""
from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
import torch

pytest.importorskip("llguidance", reason="structured outputs run on llguidance (a dependency)")

from drafttree import LLM, SamplingParams  # noqa: E402
from drafttree.sampling import SampleMode  # noqa: E402
from drafttree.structured.grammar import GrammarCompiler  # noqa: E402
from drafttree.structured.masks import _apply as masks_as_torch_ops  # noqa: E402
from drafttree.structured.masks import apply_token_masks  # noqa: E402
from drafttree.structured.params import StructuredOutputs  # noqa: E402
from drafttree.structured.tree import build_trees, grow  # noqa: E402
from tests.tiny import make_drafter, make_target, write_tokenizer  # noqa: E402

VOCAB = 128           # the character tokenizer's printable ASCII, then fillers
EOS = "<extra_0>"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "b": {"enum": ["xy", "zzz"]}, "c": {"type": "string", "maxLength": 4}},
          "required": ["a", "b", "c"], "additionalProperties": False}
REGEX = "[a-z]{2,6}-[0-9]{2}"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("structured")
    target = write_tokenizer(make_target(root / "target", "qwen3", vocab=VOCAB, scale=3.0), VOCAB, eos_token=EOS)
    return target, make_drafter(root / "drafter", target, block_size=4), AutoTokenizer.from_pretrained(str(target))


def engine(pair, spec: str, budget: int | None = None) -> LLM:
    target, drafter, _ = pair
    return LLM(model=str(target), draft_model=None if spec == "none" else str(drafter), spec=spec, budget=budget,
               device="cpu", dtype="float32", max_num_seqs=4, max_model_len=160)


@pytest.fixture(scope="module")
def plain(pair):
    return engine(pair, "none")


def batch() -> tuple[list[str], list[SamplingParams]]:
    """Constrained and free requests together, greedy and seeded."""
    schema, regex = StructuredOutputs(json=SCHEMA), StructuredOutputs(regex=REGEX)
    params = [SamplingParams(temperature=0, max_tokens=48, structured_outputs=schema),
              SamplingParams(temperature=0, max_tokens=24, structured_outputs=regex),
              SamplingParams(temperature=0, max_tokens=12),
              SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=7, max_tokens=48, structured_outputs=schema)]
    return ["hello", "abc", "xyz", "q"], params


def check_valid(outs) -> None:
    schema_out, regex_out = outs[0], outs[1]
    for o in (schema_out, outs[3]):
        assert o.finish_reason == "stop", o.text
        obj = json.loads(o.text)
        assert set(obj) == {"a", "b", "c"} and obj["b"] in ("xy", "zzz") and 0 <= obj["a"] <= 999
    assert regex_out.finish_reason == "stop" and re.fullmatch(REGEX, regex_out.text), regex_out.text


@pytest.mark.parametrize("spec,budget", [("ddtree", 8), ("dflash", 3)])
def test_speculative_constrained_equals_plain(pair, plain, spec, budget):
    prompts, params = batch()
    want = plain.generate(prompts, params)
    check_valid(want)
    llm = engine(pair, spec, budget)
    got = llm.generate(prompts, params)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids, (g.text, w.text)
        assert g.finish_reason == w.finish_reason
    # drafts queued behind the previous round were taken (the same rows), others drafted again
    times = llm.engine.constrained.times
    assert 0 < times.drafted_ahead < times.rounds
    # drafted tokens were accepted inside the grammar (forced keys, allowed candidates)
    assert max(t for o in got[:2] for t in o.metrics["accept_lengths"]) >= 3


@pytest.mark.parametrize("spec,budget,arch", [("ddtree", 8, "dflash"), ("dflash", 3, "dflash"), ("ddtree", 8, "dflash2"),
                                              ("dflash", 3, "dflash2")])
def test_only_rows_that_follow_a_grammar_grow_on_the_host(pair, plain, spec, budget, arch, tmp_path):
    """A constrained request among free ones: the host grows its tree alone (the free rows verify
    the draft's own trees, as in a free round: a DFlash2 drafter's from its selector); every
    output is plain decoding's."""
    regex = StructuredOutputs(regex=REGEX)
    prompts = ["abc", "hello", "xyz", "q"]
    params = [SamplingParams(temperature=0, max_tokens=24, structured_outputs=regex)] + \
        [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 3
    want = plain.generate(prompts, params)
    target, drafter, _ = pair
    if arch == "dflash2":
        drafter = make_drafter(tmp_path / "d2", target, block_size=4, arch="dflash2")
    llm = LLM(model=str(target), draft_model=str(drafter), spec=spec, budget=budget, device="cpu", dtype="float32",
              max_num_seqs=4, max_model_len=160)
    got = llm.generate(prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert re.fullmatch(REGEX, got[0].text), got[0].text
    times = llm.engine.constrained.times
    assert times.rounds > 3 and 0 < times.tree_nodes <= budget * times.rounds, "free rows' trees grown on the host"
    assert max(t for o in got[1:] for t in o.metrics["accept_lengths"]) >= 2, "the free rows' trees accepted nothing"


def test_rounds_go_on_while_a_grammar_is_built(pair, plain):
    """A constrained request's matcher is built on a grammar thread: the engine's rounds for the
    others go on meanwhile, and the request queues once it is built, to plain decoding's tokens;
    one aborted while it builds is gone."""
    import threading

    prompts, params = batch()
    want = plain.generate(prompts[:3], params[:3])
    llm = engine(pair, "ddtree", 8)
    eng = llm.engine
    compiler = eng.constrained.compiler
    gate, build = threading.Event(), compiler.build
    compiler.build = lambda *a: (gate.wait(30), build(*a))[1]
    free = eng.add_request(prompts[2], params[2])
    schema = eng.add_request(prompts[0], params[0])
    regex = eng.add_request(prompts[1], params[1])
    while not free.finished:
        eng.step()
    assert schema.output_ids == [] and schema.grammar is None and eng.has_unfinished()
    eng.abort(regex)
    gate.set()
    while eng.has_unfinished():
        eng.step()
    assert free.output_ids == want[2].token_ids and schema.output_ids == want[0].token_ids
    assert regex.finish_reason == "abort" and regex.output_ids == []


@pytest.mark.parametrize("spec,budget", [("ddtree", 8), ("dflash", None)])
def test_processed_constrained_rounds_are_lossless(pair, plain, spec, budget):
    """Penalties, logit_bias, bad words and log-probabilities on constrained requests (the
    grammar's masks and the logits processing per node of host-built trees): plain decoding's
    tokens and log-probabilities, the constraints kept."""
    prompts, params = batch()
    more = dict(repetition_penalty=1.3, presence_penalty=0.4, logit_bias={ord("7") - 31: 2.0}, bad_words=["qq"],
                logprobs=2)
    params = [dataclasses.replace(p, **more) for p in params]
    want = plain.generate(prompts, params)
    check_valid(want)
    assert [w.token_ids for w in want] != [o.token_ids for o in plain.generate(*batch())]
    got = engine(pair, spec, budget).generate(prompts, params)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids, (g.text, w.text)
        for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert list(a) == list(b) and all(a[t].logprob == pytest.approx(b[t].logprob, rel=1e-5, abs=1e-5)
                                              for t in a)


def test_decode_and_drafting_rounds_alternate(pair, plain):
    """A free request capped at budget 0 makes its rounds masked decode steps (with the drafter's
    context kept); once it ends, the constrained rounds draft again: the same tokens throughout."""
    prompts, params = batch()
    params[2] = SamplingParams(temperature=0, max_tokens=9, max_budget=0)
    want = plain.generate(prompts, params)
    got = engine(pair, "ddtree", 8).generate(prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert 1 in got[0].metrics["accept_lengths"] and max(got[0].metrics["accept_lengths"]) > 1


def test_auto_prices_constrained_rounds_apart(pair, plain):
    """With `budget auto`, the rounds of a batch holding a constrained request are observed as a
    kind of their own (their host work is theirs), the free rounds as theirs; the tokens stay plain
    constrained decoding's."""
    prompts, params = batch()
    llm = engine(pair, "ddtree")
    seen: list[bool] = []
    host_rows: list[int] = []
    observe, choose = llm.engine.chooser.observe_round, llm.engine.chooser.choose

    def drafting(bucket, allowed, rows, cap=None, extra=(), host_rows=0):
        # constrained rounds draft whatever the measured prices say (a loaded machine may price
        # them plain), so that the rounds with all three grammars running are observed
        budget = choose(bucket, allowed, rows, cap, extra, host_rows)
        return max(b for b in allowed if cap is None or b <= cap) if "constrained" in extra else budget
    llm.engine.chooser.choose = drafting

    def spy(bucket, budget, sampled, seconds, extra=(), host_s=0.0, rows=0):
        seen.append("constrained" in extra)
        if "constrained" in extra and budget:
            host_rows.append(rows)
        return observe(bucket, budget, sampled, seconds, extra, host_s, rows)
    llm.engine.chooser.observe_round = spy
    got = llm.generate(prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in plain.generate(prompts, params)]
    llm.generate(prompts[2:3], params[2:3])    # a free request alone
    assert True in seen and False in seen
    # the host's work is priced by the rows that follow a grammar (three of the four at first)
    assert host_rows and max(host_rows) == 3 and min(host_rows) >= 1
    assert any("constrained" in k[3] for k in llm.engine.chooser.cost_ratio)
    assert any(not k[3] for k in llm.engine.chooser.cost_ratio)
    llm.shutdown()


def test_constrained_rounds_calibrate_the_acceptance(pair, plain):
    """With `budget auto`, an engine serving only constrained requests learns their acceptance
    from their own rounds (the free tree's prediction against what the masked verify of the
    grammar's tree gave), instead of drafting uncalibrated at the largest budget for good."""
    from drafttree.engine.budget import sampler_key

    prompts, params = batch()
    llm = engine(pair, "ddtree")
    chooser = llm.engine.chooser
    con = [i for i, p in enumerate(params) if p.structured_outputs is not None]
    got = llm.generate([prompts[i] for i in con], [params[i] for i in con])
    assert [g.token_ids for g in got] == [w.token_ids for w in plain.generate([prompts[i] for i in con],
                                                                             [params[i] for i in con])]
    keys = {sampler_key(params[i]) for i in con}
    assert keys == {k for k, c in chooser.cal.items() if c.pred is not None}
    assert chooser.pooled[True].pred is not None and chooser.pooled[False].pred is not None
    llm.shutdown()


def masked_greedy(target, tok, compiler: GrammarCompiler, so: StructuredOutputs, prompt: str, n: int) -> list[int]:
    """Plain constrained greedy decoding with transformers' forward of the same checkpoint."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    m = compiler.matcher(so)
    ids = tok.encode(prompt)
    out: list[int] = []
    mask = np.zeros((1, compiler.words), dtype=np.int32)
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([ids + out])).logits[0, -1]
        compiler.fill_masks([(m, 0)], mask)
        bits = np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:VOCAB].astype(bool)
        logits[~torch.from_numpy(bits)] = float("-inf")
        t = int(logits.argmax())
        out.append(t)
        if t == tok.eos_token_id:
            break
        assert m.advance([t]) == 1
    return out


def test_plain_constrained_equals_independent_masked_decode(pair, plain):
    target, _, tok = pair
    so = StructuredOutputs(regex=REGEX)
    (out,) = plain.generate(["abc"], SamplingParams(temperature=0, max_tokens=24, structured_outputs=so))
    compiler = plain.engine.constrained.compiler
    assert out.token_ids == masked_greedy(target, tok, compiler, so, "abc", 24)


def test_masks_filled_in_this_thread_or_the_pool_are_the_same(pair):
    """A few masks are computed in the calling thread, more in llguidance's thread pool (where
    the machine has CPUs for one): the same bits either way, each in its own row, other rows
    untouched; a closed object allows its end of sequence alone."""
    import llguidance

    from drafttree.structured import grammar

    _, _, tok = pair
    compiler = GrammarCompiler(tok, VOCAB, {tok.eos_token_id})
    so = StructuredOutputs(json=SCHEMA)
    texts = ["", '{"', '{"a": 1', '{"a": 12, "b": "x', '{"a": 3, "b": "xy", "c": "', '{"a": 3, "b": "zzz", "c": ""}']
    ms = []
    for i in range(grammar.SERIAL_MASKS + 9):
        m = compiler.matcher(so)
        m.advance(tok.encode(texts[i % len(texts)], add_special_tokens=False))
        ms.append(m)
    rows = np.random.default_rng(0).permutation(len(ms) + 3)[:len(ms)]   # rows out of order, some left as they were
    for n in (3, len(ms)):   # the calling thread's path, then more than SERIAL_MASKS
        got = []
        for executor in (None, llguidance.LLExecutor(2)):
            compiler.executor = executor
            out = np.full((len(ms) + 3, compiler.words), 7, dtype=np.int32)
            compiler.fill_masks([(m, int(r)) for m, r in zip(ms[:n], rows)], out)
            got.append(out)
        assert np.array_equal(got[0], got[1])
        untouched = np.setdiff1d(np.arange(len(ms) + 3), rows[:n])
        assert (got[0][untouched] == 7).all()
    ended = got[0][rows[5]].view(np.uint32)
    assert [t for t in range(VOCAB) if ended[t >> 5] >> (t & 31) & 1] == [tok.eos_token_id]


def test_seeded_constrained_sampling_follows_the_masked_distribution(pair, plain):
    """At T = 1 the first token of `choice` over many seeds is distributed as the target's softmax
    restricted to the tokens the grammar allows (chi-square, p > 0.001)."""
    from transformers import AutoModelForCausalLM

    target, _, tok = pair
    so = StructuredOutputs(choice=("a1", "b2", "c3", "d4"))
    n = 240
    outs = plain.generate(["zz"] * n, [SamplingParams(temperature=1.0, seed=s, max_tokens=1, structured_outputs=so)
                                       for s in range(n)])
    first = [o.token_ids[0] for o in outs]
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([tok.encode("zz")])).logits[0, -1]
    allowed = [tok.convert_tokens_to_ids(c) for c in "abcd"]
    p = torch.softmax(logits[allowed], -1).tolist()
    counts = [first.count(t) for t in allowed]
    assert sum(counts) == n, "a token the grammar forbids was sampled"
    chi2 = sum((c - n * q) ** 2 / (n * q) for c, q in zip(counts, p))
    assert chi2 < 16.27, (counts, p)   # 3 degrees of freedom, p = 0.001


def test_trees_hold_only_allowed_tokens(pair, plain):
    compiler = plain.engine.constrained.compiler
    _, _, tok = pair
    m = compiler.matcher(StructuredOutputs(json=SCHEMA))
    D, K = 3, 6
    g = torch.Generator().manual_seed(0)
    lp = torch.log_softmax(torch.randn(1, D, VOCAB, generator=g), -1)
    top_lp, top_idx = (x.numpy() for x in lp.topk(K, -1))
    toks, parents, depths, states = grow(top_lp[0], top_idx[0], 9, m, False, {tok.eos_token_id})
    assert toks, "a tree of the root alone"
    assert toks[0] == tok.convert_tokens_to_ids("{"), "the forced first token was not drafted"
    for i, t in enumerate(toks):   # every node is allowed by its parent's state
        path, j = [], i + 1
        while j:
            path.append(toks[j - 1])
            j = parents[j - 1]
        assert compiler.matcher(StructuredOutputs(json=SCHEMA)).advance(path[::-1]) == len(path)
    two = lambda x: np.repeat(x, 2, axis=0)  # noqa: E731
    trees = build_trees(two(top_lp), two(top_idx), [7, 5], 10, 12, [None, m], True, compiler, {tok.eos_token_id})
    assert trees.rows.tolist() == [1], "a free row's tree grown on the host"
    assert trees.tokens.shape == (1, 12) and trees.masks.shape[:2] == (1, 10) and trees.tokens[0, 0] == 5
    assert (trees.parents[0, 1:][trees.valid[0, 1:]] == np.arange(trees.valid[0, 1:].sum())).all(), "not a chain"
    assert not trees.valid[0, 10:].any() and (trees.parents[0, 10:] == 0).all()
    v = trees.valid[0, :10]
    assert (trees.masks[0][v] != -1).any(axis=1).all(), "a node without its own state's mask"
    assert (trees.masks[0][~v] == -1).all(), "an invalid node's mask forbids a token"


@pytest.mark.parametrize("so,what", [
    (dict(json={"type": "array", "uniqueItems": True}), "uniqueItems"),
    (dict(json={"not": {"type": "string"}}), "not"),
    (dict(regex="[0-9"), "unclosed character class"),
    (dict(grammar="start: foo"), "foo"),
])
def test_unsupported_constraints_refused_by_name(plain, so, what):
    with pytest.raises(ValueError, match=re.escape(what)):
        plain.generate(["x"], SamplingParams(temperature=0, max_tokens=4, structured_outputs=StructuredOutputs(**so)))
    (ok,) = plain.generate(["x"], SamplingParams(temperature=0, max_tokens=3))   # the engine goes on
    assert len(ok.token_ids) == 3


def test_bad_parameters():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(regex="a", choice=("a",))
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputs(regex="a"))
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputs(json="{")


def test_constrained_rounds_replay_their_graphs_or_run_eagerly(pair, plain, fake_cuda_graphs):
    """With CUDA graphs the constrained round's steps have graphs of their own; with
    structured_graphs off they run eagerly (counted), to the same tokens either way."""
    target, drafter, _ = pair
    prompts, params = batch()
    want = [o.token_ids for o in plain.generate(prompts, params)]
    for structured in (True, False):
        llm = LLM(model=str(target), draft_model=str(drafter), spec="ddtree", budget=8, device="cpu",
                  dtype="float32", max_num_seqs=4, max_model_len=160, cuda_graphs=True, prefill_graphs=False,
                  structured_graphs=structured)
        gr = llm.engine.runner.graphs
        assert any(k.constrained for k in gr.graphs) == structured
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
        assert (gr.fallbacks > 0) != structured


def test_token_masks_forbid_exactly_the_cleared_bits():
    """Bit t % 32 of word t // 32 allows token t: every other token's logit becomes -inf, the
    allowed ones keep theirs (a vocabulary that ends mid-word, words with the sign bit set)."""
    g = torch.Generator().manual_seed(3)
    R, N, V = 2, 3, 70
    logits = torch.randn(R, N, V, generator=g)
    masks = torch.randint(-2**31, 2**31 - 1, (R, N, (V + 31) // 32), generator=g, dtype=torch.int64).to(torch.int32)
    masks[0, 0, 0] = -2**31   # token 31 alone in the first word
    masks[1, 2] = -1          # a free row's node: every token allowed
    got = apply_token_masks(logits, masks)
    assert torch.equal(got, masks_as_torch_ops(logits, masks)), "the host's form differs from the device's"
    for r in range(R):
        for n in range(N):
            for t in range(V):
                allowed = (int(masks[r, n, t // 32]) >> (t % 32)) & 1
                assert got[r, n, t] == (logits[r, n, t] if allowed else float("-inf")), (r, n, t)
    assert torch.isinf(got[0, 0, :31]).all() and got[0, 0, 31] == logits[0, 0, 31]


def test_warm_up_builds_the_grammar_engine_and_forgets_what_it_taught_the_choice(pair):
    """A server's warm-up runs a constrained request too (the grammar engine is built then, not at
    the first real one), and afterwards the budget choice holds nothing its synthetic prompts
    taught it: acceptance and round prices are learned from real requests."""
    from drafttree.engine.warmup import warm_up

    eng = engine(pair, "ddtree").engine
    assert eng.spec.adaptive and eng.constrained._compiler is None
    assert warm_up(eng) == 2
    assert eng.constrained._compiler is not None
    c = eng.chooser
    assert not c.cal and not c.cost_ratio and not c.host_node and all(p.pred is None for p in c.pooled.values())
    prompts, params = batch()
    assert eng.add_request(prompts[0], params[0]) is not None
    while eng.has_unfinished():
        eng.step()
    assert c.cal or c.cost_ratio   # learning again, from the request
    eng.shutdown()


def test_a_prefill_between_drops_the_draft_queued_ahead(pair, plain):
    """A draft queued ahead serves the next round only when no prefill ran between: a request
    preempted and admitted again holds its old row, with its state written anew, and the draft
    made before is not its draft any more. Its tokens stay plain constrained decoding's."""
    from drafttree.engine.engine import Engine, EngineConfig

    target, drafter, _ = pair
    prompts, params = batch()
    eng = Engine(EngineConfig(model=str(target), draft_model=str(drafter), spec="ddtree", budget=8, device="cpu",
                              dtype="float32", max_num_seqs=4, max_model_len=160))
    seq = eng.add_request(prompts[0], params[0])
    while eng.constrained.ahead is None:
        eng.step()
    before, row = eng.constrained.times.drafted_ahead, seq.row
    eng.scheduler.preempt(seq)
    eng.step()   # admitted again into the same row: its prefill, then a round that drafts anew
    assert seq.row == row and eng.constrained.times.drafted_ahead == before
    eng.step()   # nothing written since: the draft queued ahead is taken
    assert eng.constrained.times.drafted_ahead == before + 1
    while eng.has_unfinished():
        eng.step()
    assert seq.output_ids == plain.generate(prompts[:1], params[:1])[0].token_ids
    eng.shutdown()


def deferred(pair, **kw):
    """An engine whose constrained and processed rounds' graphs are left for later (`kw`: its
    config), the batch's prompts and parameters (a processed request added) and a function that
    decodes them on it."""
    from drafttree.engine.engine import Engine, EngineConfig

    target, drafter, _ = pair
    prompts, params = batch()
    prompts, params = prompts + ["xyz"], params + [SamplingParams(temperature=0, max_tokens=12, logprobs=2,
                                                                  presence_penalty=0.5)]
    cfg = dict(model=str(target), draft_model=str(drafter), spec="ddtree", budget=8, dtype="float32",
               max_num_seqs=8, max_model_len=160, defer_graphs=True, **kw)
    eng = Engine(EngineConfig(**cfg))

    def generate() -> list[list[int]]:
        seqs = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
        while eng.has_unfinished():
            eng.step()
        return [s.output_ids for s in seqs]
    return eng, cfg, (prompts, params), generate


def test_graphs_left_for_later_are_captured_while_idle(pair, plain, fake_cuda_graphs, monkeypatch):
    """defer_graphs: the engine starts with the first sets' free rounds' graphs only; until their sets are
    captured, constrained and processed rounds run eagerly (not counted as fallbacks) to the same
    tokens; a server's engine thread captures them while no request runs, one graph at a time,
    with what is alive frozen out of the cyclic collector's walks (at its start and after each
    piece) until it stops."""
    import gc
    import time

    from drafttree.engine.engine import Engine, EngineConfig
    from drafttree.server import worker as worker_module
    from drafttree.server.worker import EngineWorker

    frozen: list[int] = []
    settle_collector = worker_module.settle_collector

    def settle() -> None:
        settle_collector()
        frozen.append(gc.get_freeze_count())

    monkeypatch.setattr(worker_module, "settle_collector", settle)

    eng, cfg, (prompts, params), generate = deferred(pair, device="cpu", cuda_graphs=True, prefill_graphs=False)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    gr = eng.runner.graphs
    sets, started = len(gr.sets()), len(gr.set_seconds)
    # the start captures the sets that serve every round, the others later (`first_sets`); the pieces
    # compile after start-up too (`prepare.compiles_later`): those steps, then the start's sets again
    jobs = len(eng.runner.compile_jobs)
    assert len(gr.pending) == sets > started == len(gr.upgrade) > 0 and jobs > 0
    assert eng.graphs_pending == jobs + sets + started
    assert not any(k.constrained or k.processed for k in gr.graphs)
    assert generate() == want
    assert gr.fallbacks == 0
    while eng.runner.compile_jobs or gr.upgrade:
        eng.capture_later()
    assert eng.graphs_pending == sets
    # a constrained round at a length no set was planned for falls back, counted, pending or not
    masked = eng.runner.round_steps(1, SampleMode.GREEDY, 0, constrained=True)
    assert not gr.replay(1, SampleMode.GREEDY, max(gr.kv_lengths) + 1, masked) and gr.fallbacks == 1
    gr.fallbacks = 0
    n = len(gr.graphs)
    assert eng.capture_later() and len(gr.graphs) == n + 1   # one graph a call
    while eng.graphs_pending == sets:
        eng.capture_later()
    assert eng.graphs_pending == sets - 1   # a set leaves with its last graph
    worker, pieces, capture_later = EngineWorker(eng), [], eng.capture_later
    monkeypatch.setattr(eng, "capture_later", lambda: pieces.append(1) or capture_later())
    worker.start()
    deadline = time.monotonic() + 60
    while eng.graphs_pending and time.monotonic() < deadline:
        time.sleep(0.05)
    worker.stop()
    assert eng.graphs_pending == 0 and gr.later == (False, False)
    assert pieces and len(frozen) == 1 + len(pieces) and min(frozen) > 0 and gc.get_freeze_count() == 0
    assert any(k.constrained for k in gr.graphs) and any(k.processed for k in gr.graphs)
    n = len(gr.graphs)
    assert generate() == want
    assert gr.fallbacks == 0 and len(gr.graphs) == n   # replayed: nothing captured on a request's path
    eng.shutdown()
    with pytest.raises(ValueError, match="defer_graphs needs CUDA graphs"):
        Engine(EngineConfig(**{**cfg, "cuda_graphs": False}))
    with pytest.raises(ValueError, match="defer_graphs is the server's"):
        LLM(**cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("spec,budget", [("ddtree", 8), ("ddtree", None), ("dflash", 3)])
def test_speculative_constrained_equals_plain_on_the_gpu(pair, spec, budget):
    """On CUDA (bf16, CUDA graphs, the constrained rounds' graphs captured) in deterministic mode,
    where speculative decoding gives plain decoding's bits: every output of the mixed batch,
    JSON and regex at T = 0 and a seeded JSON request among them, equals plain constrained
    decoding's (`budget` None: the per-round choice)."""
    target, drafter, _ = pair
    common = dict(model=str(target), device="cuda", dtype="bfloat16", deterministic=True, max_num_seqs=4,
                  max_model_len=160)
    prompts, params = batch()
    plain = LLM(spec="none", **common)
    want = plain.generate(prompts, params)
    llm = LLM(draft_model=str(drafter), spec=spec, budget=budget, **common)
    got = llm.generate(prompts, params)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids, (g.text, w.text)
        assert g.finish_reason == w.finish_reason
    assert llm.engine.constrained.times.rounds > 0
    assert llm.engine.runner.graphs.fallbacks == 0


@pytest.mark.gpu
def test_graphs_captured_later_replay_what_eager_rounds_ran_on_the_gpu(pair):
    """On CUDA, with graphs captured for real: the constrained and processed rounds run eagerly
    while their sets are pending, then from the graphs captured after serving began, to the same
    tokens (fp32), with no fallback."""
    eng, _, _, generate = deferred(pair, device="cuda")
    gr = eng.runner.graphs
    assert eng.graphs_pending > 0 and not any(k.constrained or k.processed for k in gr.graphs)
    eager = generate()
    assert all(eager)
    while eng.capture_later():
        pass
    assert eng.graphs_pending == 0 and any(k.constrained for k in gr.graphs) and any(k.processed for k in gr.graphs)
    assert generate() == eager
    assert gr.fallbacks == 0
    eng.shutdown()


def test_constrained_rounds_over_two_ranks_give_one_ranks_tokens(pair, plain):
    """Tensor parallel (two gloo ranks on the CPU): constrained rounds, their drafts queued ahead
    (each a command the other rank runs too, behind the pages the scheduler reserved for it) and
    the masked verifies give plain constrained decoding's tokens, and the ranks agree after."""
    target, drafter, _ = pair
    prompts, params = batch()
    want = [o.token_ids for o in plain.generate(prompts, params)]
    llm = LLM(model=str(target), draft_model=str(drafter), spec="ddtree", budget=8, device="cpu", dtype="float32",
              max_num_seqs=4, max_model_len=160, tensor_parallel_size=2)
    try:
        got = llm.generate(prompts, params)
        assert llm.engine.agree()
        assert llm.engine.constrained.times.drafted_ahead > 0
    finally:
        llm.shutdown()
    assert [g.token_ids for g in got] == want


@pytest.mark.parametrize("where", ["midway", "near the context's end"])
def test_a_constrained_request_admitted_while_a_plain_round_is_unread(pair, plain, where):
    """Overlapped plain rounds, then a constrained request arrives: the constrained round reads
    the round in flight before it launches (its host grows the trees from every row's last
    token, and its draft ahead starts where those commits end), so the free request's tokens stay
    plain decoding's, up to the context's end, and the constrained one's plain constrained
    decoding's."""
    from drafttree.engine.engine import Engine, EngineConfig

    target, drafter, _ = pair
    M = 160
    eng = Engine(EngineConfig(model=str(target), draft_model=str(drafter), spec="ddtree", budget=8, device="cpu",
                              dtype="float32", max_num_seqs=4, max_model_len=M, overlap=True))
    c = eng.spec.commit_bound(8)
    lo, hi = (50, 60) if where == "midway" else (M - 2 * c, M - c)
    x = eng.add_request("hello world " * 3, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    while not (eng._inflight is not None and lo < x.length <= hi):
        assert x.length <= hi, "the plain request passed the window this test needs"
        eng.step()
    regex = SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputs(regex=REGEX))
    y = eng.add_request("q", regex)
    while eng.has_unfinished():
        eng.step()
    assert y.output_ids == plain.generate(["q"], [regex])[0].token_ids
    to_the_end = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    assert x.output_ids == plain.generate(["hello world " * 3], [to_the_end])[0].token_ids
    eng.shutdown()


@pytest.mark.parametrize("spec,budget", [("dflash", None), ("ddtree", 8)])
def test_a_grammar_ends_the_output_where_the_model_has_no_end_of_sequence(tmp_path, spec, budget):
    """A tokenizer without an end-of-sequence token: a constrained request ends at the token that
    completes its grammar, under speculation as in plain decoding (whose round may have committed
    tokens past it)."""
    target = write_tokenizer(make_target(tmp_path / "t", "qwen3", vocab=97, layers=2, scale=3.0), 97)
    drafter = make_drafter(tmp_path / "d", target, block_size=4)
    sp = SamplingParams(temperature=0, max_tokens=20,
                        structured_outputs=StructuredOutputs(regex="[a-c]{2,6}( [d-f]+)?"))
    prompts = ["hello there", "abc", "zzz qq", "the cat"]

    def run(spec: str, budget: int | None) -> list[tuple[list[int], str]]:
        llm = LLM(model=str(target), draft_model=None if spec == "none" else str(drafter), spec=spec,
                  budget=budget, device="cpu", dtype="float32", max_num_seqs=4)
        assert not llm.engine.eos_ids
        return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in llm.generate(prompts, sp)]

    want = run("none", None)
    assert any(reason == "stop" for _, reason in want)
    assert run(spec, budget) == want


def test_token_filters_that_leave_the_grammar_nothing_abort_the_request_by_name(pair, plain, caplog):
    """allowed_token_ids that the grammar's first character is not among: the request ends
    ("abort"), and the log names the filter, not only the grammar."""
    _, _, tok = pair
    digits = [tok.convert_tokens_to_ids(c) for c in "0123456789"]
    sp = SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=digits,
                        structured_outputs=StructuredOutputs(regex=REGEX))
    with caplog.at_level("ERROR"):
        out = plain.generate(["hello"], sp)[0].outputs[0]
    assert out.finish_reason == "abort"
    assert "allowed_token_ids may leave the grammar no token" in caplog.text
