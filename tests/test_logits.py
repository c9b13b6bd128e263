"""Logits processing and log-probabilities (CPU, fp32, tiny random models): every parameter that
processes the target's logits (penalties, logit_bias, min_tokens, bad words of one and of several
tokens, allowed_token_ids, stop_token_ids, min_p) gives plain decoding's tokens under DFlash and
DDTree, greedy and seeded, and plain decoding's tokens are an independent decode's (the
transformers model's logits processed as vLLM defines each parameter); log-probabilities are the
target's own (transformers' log-softmax) whichever method commits the token; prompt
log-probabilities likewise; n choices come back in index order, each as the request alone with
seed + index, their prompt's pages computed once and shared.

The tree-path processing itself is checked node by node against each node's path processed as
plain decoding would see it (random trees, random output histories)."""
from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

from drafttree import LLM, SamplingParams
from drafttree.sampling import gumbel_noise
from drafttree.spec_decode.logits import LogitsBuffers, RowLogits, commit_output, process_logits
from drafttree.spec_decode.tree import ancestor_mask
from tests.helpers import gpu
from tests.tiny import make_drafter, make_target, write_tokenizer

V = 12                  # the character tokenizer's first ids: "<unk>", " ", "!", '"', "#", "$", "%", "&", "'", ...
SHAPES = ["qwen3", "llama"]
PROMPTS = [[1, 2, 3, 2, 4], [5, 6, 7, 8, 1, 2, 3, 4, 9, 10, 11], [3]]
MAX_TOKENS = 20
METHODS = {"none": (None, None), "dflash": ("dflash", 1), "ddtree": ("ddtree", 16)}


# -- the tree-path processing, node by node -----------------------------------------------------

def random_tree(W: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """parents, depth, visible [1, W(, W)] of a random tree whose parents precede their children."""
    parents, depth = [0], [0]
    for i in range(1, W):
        p = int(torch.randint(0, i, (1,), generator=gen))
        parents.append(p)
        depth.append(depth[p] + 1)
    parents_t = torch.tensor([parents])
    return parents_t, torch.tensor([depth]), ancestor_mask(parents_t, W)


def path_of(node: int, parents: list[int]) -> list[int]:
    out = []
    while node:
        out.append(node)
        node = parents[node]
    return out[::-1]


def vllm_processed(x: torch.Tensor, r: RowLogits, output: list[int], temp: float) -> torch.Tensor:
    """One position's logits x [V] processed as vLLM's sampler defines each parameter, for a
    request whose output so far is `output` (written here from the definitions, not the engine's
    code): allowed tokens, bad words (a word's last token when the output ends with its others),
    min_tokens' stop tokens, logit_bias, then repetition (prompt and output), frequency and
    presence penalties (output), then min_p on the tempered distribution."""
    x = x.clone()
    if r.allowed is not None:
        keep = torch.zeros_like(x, dtype=torch.bool)
        keep[r.allowed] = True
        x[~keep] = float("-inf")
    for w in [[t] for t in r.banned] + r.words:
        if len(w) == 1 or output[len(output) - len(w) + 1:] == w[:-1]:
            x[w[-1]] = float("-inf")
    if len(output) < r.min_tokens:
        x[r.stops] = float("-inf")
    for t, b in r.bias.items():
        x[t] = x[t] + torch.tensor(b)
    counts = Counter(output)
    rep, freq, pres = (torch.tensor(v) for v in (r.repetition, r.frequency, r.presence))
    for t in set(r.prompt) | set(output):
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    for t, c in counts.items():
        x[t] = x[t] - freq * c
        x[t] = x[t] - pres
    if r.min_p > 0:
        probs = torch.softmax(x / (temp if temp > 0 else 1.0), -1)
        x[probs < probs.max() * r.min_p] = float("-inf")
    return x


@pytest.mark.parametrize("seed", range(6))
def test_each_tree_node_is_processed_as_its_path_alone(seed):
    """process_logits over a random tree equals, at every node, vLLM's processing of the output
    that node's path gives (the row's output, then the path's draft tokens), for a row with
    every parameter at once: repeated tokens on the paths, bad words ending inside the output
    and on the path, stop tokens banned up to a min_tokens inside the tree's depth."""
    gen = torch.Generator().manual_seed(seed)
    W, vocab = 24, 6
    # the output ends inside bad words: [2, 3] bans 3 at the root, [0, 2, 2, 4] 4 after a path's 2
    output = torch.randint(0, vocab, (int(torch.randint(0, 5, (1,), generator=gen)),), generator=gen).tolist()
    output += [3, 0, 2] if seed % 2 else [3, 3]
    row = RowLogits(repetition=1.7, frequency=0.4, presence=0.3, min_p=0.2 if seed % 2 else 0.0,
                    bias={1: 1.5, 4: -0.75}, allowed=[0, 1, 2, 3, 4] if seed % 3 == 0 else None, banned=[5],
                    words=[[2, 3], [3, 3, 1], [0, 2, 2, 4]], stops=[3], min_tokens=len(output) + 3,
                    prompt=[4, 0, 4], output=output)
    lb = LogitsBuffers.allocate(2, vocab, 4, 3, "cpu")
    lb.write_row(1, row)
    parents, depth, visible = random_tree(W, gen)
    tokens = torch.randint(0, vocab, (1, W), generator=gen)
    x = torch.randn(1, W, vocab, generator=gen) * 3
    temp = torch.tensor([0.8])
    got = process_logits(x, lb.rows(slice(1, 2)), tokens, parents, depth, visible, temp)
    for i in range(W):
        path = [int(tokens[0, j]) for j in path_of(i, parents[0].tolist())]
        want = vllm_processed(x[0, i], row, output + path, 0.8)
        assert torch.equal(got[0, i].isinf(), want.isinf()), f"node {i} (path {path}): masks differ"
        torch.testing.assert_close(got[0, i], want, rtol=0, atol=1e-6, msg=f"node {i} (path {path})")


def test_committing_grows_the_output_state_as_the_output():
    """commit_output over rounds of different lengths leaves the counts, the tail and the length
    of the whole output, as writing the row from that output does."""
    lb = LogitsBuffers.allocate(1, 9, 4, 0, "cpu")
    out = [3, 1]
    lb.write_row(0, RowLogits(output=out))
    for tokens in ([4, 4, 2, 0], [7], [1, 2, 3], [8, 8, 8, 8] * 4):
        for at in range(0, len(tokens), 4):
            part = tokens[at:at + 4]
            commit_output(lb, torch.tensor([part + [0] * (4 - len(part))]), torch.tensor([len(part)]))
        out += tokens
    fresh = LogitsBuffers.allocate(1, 9, 4, 0, "cpu")
    fresh.write_row(0, RowLogits(output=out))
    for name in ("counts", "tail", "out_len"):
        assert torch.equal(getattr(lb, name), getattr(fresh, name)), name


# -- end to end ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """shape -> (target dir, {method: LLM}); each target has the character tokenizer."""
    made = {}

    def get(shape: str):
        if shape not in made:
            root = tmp_path_factory.mktemp(f"logits-{shape}")
            target = make_target(root / "target", shape, vocab=V, scale=3.0)
            write_tokenizer(target, V)
            drafter = make_drafter(root / "drafter", target, block_size=4)
            llms = {m: LLM(model=str(target), draft_model=None if spec is None else str(drafter), spec=spec or "none",
                           budget=budget, device="cpu", dtype="float32", max_num_seqs=4, max_model_len=96)
                    for m, (spec, budget) in METHODS.items()}
            made[shape] = target, llms
        return made[shape]
    return get


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    loaded = {}

    def get(target):
        if target not in loaded:
            loaded[target] = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
        return loaded[target]
    return get


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """The transformers model's logits [len(ids), V] at every position."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def reference(model, prompt: list[int], p: SamplingParams, tok) -> list[int]:
    """Plain decoding written from the definitions: transformers' logits at each step, processed
    as vLLM defines the parameters (`vllm_processed`), picked greedily or by the Gumbel-max rule
    with the engine's noise of (seed, position, token)."""
    words = [tok.encode(w, add_special_tokens=False) for w in p.bad_words or []]
    stops = list(p.stop_token_ids)
    row = RowLogits(p.repetition_penalty, p.frequency_penalty, p.presence_penalty, p.min_p, dict(p.logit_bias or {}),
                    p.allowed_token_ids, [w[0] for w in words if len(w) == 1], [w for w in words if len(w) > 1],
                    stops, p.min_tokens, prompt)
    out: list[int] = []
    while len(out) < p.max_tokens:
        x = vllm_processed(hf_logits(model, prompt + out)[-1], row, out, p.temperature)
        if p.temperature == 0:
            t = int(x.argmax())
        else:
            noise = gumbel_noise(torch.tensor([p.seed]), torch.tensor([[len(prompt) + len(out)]]), x.shape[0])[0, 0]
            t = int((x / p.temperature + noise).argmax())
        out.append(t)
        if t in stops:
            break
    return out


def both(**kw) -> list[SamplingParams]:
    """The parameters greedy and seeded (at T 0.9), for the three prompts."""
    g = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, **kw)
    s = SamplingParams(temperature=0.9, seed=11, max_tokens=MAX_TOKENS, **kw)
    return [g, s, dataclasses.replace(g, max_tokens=MAX_TOKENS * 3 // 4)]


# one token, two tokens and three ("(": 9; '"#': 3 4; "$!": 5 2; '#"#': 4 3 4; "$$$": 5 5 5), each
# of which unprocessed decoding of these models writes
BAD_WORDS = ["(", '"#', "$!", '#"#', "$$$"]
PARAMS = {
    "penalties": both(presence_penalty=0.9, frequency_penalty=0.7),
    "repetition": both(repetition_penalty=1.8),
    "logit_bias": both(logit_bias={2: 2.5, 5: -100.0, 9: 1.0}),
    "min_tokens": both(min_tokens=12, stop_token_ids=[4, 7]),
    "stop_token_ids": both(stop_token_ids=[4]),
    "bad_words": both(bad_words=BAD_WORDS),
    "allowed_token_ids": both(allowed_token_ids=[1, 3, 5, 7, 8, 10]),
    "min_p": both(min_p=0.25),
    "everything": both(presence_penalty=-0.5, frequency_penalty=0.3, repetition_penalty=1.3, logit_bias={3: 1.0},
                       min_tokens=5, stop_token_ids=[9], bad_words=["#", "$%"], min_p=0.1, logprobs=2),
}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", list(PARAMS))
def test_each_parameter_is_lossless_and_as_defined(models, hf_model, shape, name):
    target, llms = models(shape)
    params = PARAMS[name]
    got = {m: llm.generate(PROMPTS, params, use_tqdm=False) for m, llm in llms.items()}
    plain = [o.token_ids for o in got["none"]]
    tok = llms["none"].get_tokenizer()
    assert plain == [reference(hf_model(target), p, sp, tok) for p, sp in zip(PROMPTS, params)]
    for m in ("dflash", "ddtree"):
        assert [o.token_ids for o in got[m]] == plain, m
        assert [o.finish_reason for o in got[m]] == [o.finish_reason for o in got["none"]], m
    taus = [t for o in got["ddtree"] for t in o.metrics["accept_lengths"]]
    assert max(taus) >= 2, taus   # drafted tokens were accepted through the processed verify


def test_the_parameters_change_the_output(models):
    """Each parameter set makes plain decoding's output differ from unprocessed decoding's (a
    parameter accepted and ignored would pass the tests above), and keeps what it promises."""
    _, llms = models("qwen3")
    llm = llms["none"]
    free = [o.token_ids for o in llm.generate(PROMPTS, both(), use_tqdm=False)]
    for name, params in PARAMS.items():
        outs = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        assert outs != free, name
    tok = llm.get_tokenizer()
    for o in llm.generate(PROMPTS, PARAMS["bad_words"], use_tqdm=False):
        text = tok.decode(o.token_ids)
        assert not any(w in text for w in BAD_WORDS), text
    for o in llm.generate(PROMPTS, PARAMS["allowed_token_ids"], use_tqdm=False):
        assert set(o.token_ids) <= {1, 3, 5, 7, 8, 10}
    for o, p in zip(llm.generate(PROMPTS, PARAMS["min_tokens"], use_tqdm=False), PARAMS["min_tokens"]):
        assert not set(o.token_ids[:12]) & {4, 7}
        assert o.finish_reason == "length" or (o.token_ids[-1] in (4, 7) and o.outputs[0].stop_reason in (4, 7))


def test_a_batch_mixes_processed_and_plain_rows(models):
    """Rows without processing beside processed ones, across several rounds of admissions (rows
    reused, moved when others finish): each request's tokens are its own, alone."""
    _, llms = models("qwen3")
    params = [SamplingParams(temperature=0.0, max_tokens=n, **kw) for n, kw in
              ((6, {}), (20, {"repetition_penalty": 1.5}), (9, {}), (14, {"bad_words": ["#$"], "logprobs": 1}),
               (20, {"logit_bias": {4: 3.0}}), (12, {}))]
    prompts = PROMPTS * 2
    for m in ("none", "ddtree"):
        together = [o.token_ids for o in llms[m].generate(prompts, params, use_tqdm=False)]
        alone = [llms["none"].generate([p], sp, use_tqdm=False)[0].token_ids for p, sp in zip(prompts, params)]
        assert together == alone, m


@pytest.mark.parametrize("overlap", [False, True])
def test_preempted_processed_requests_resume_their_output_state(models, overlap):
    """A pool too small for the batch: processed requests (a repetition penalty over prompt and
    output, a three-token bad word, min_tokens, log-probabilities; n = 2 sharing their prompt's
    pages) are preempted and recomputed, their rows written again from the output so far, and
    give the tokens and log-probabilities they give with room to spare, under DDTree."""
    from tests.helpers import Pair, pool_gb

    target, llms = models("llama")
    pair = Pair(target, target.parent / "drafter", V)
    prompts = [(PROMPTS[1] * 3)[:30], PROMPTS[0] * 5, PROMPTS[1][:12], (PROMPTS[0] + PROMPTS[1]) * 2]
    params = [SamplingParams(temperature=0.0, max_tokens=40, repetition_penalty=1.4, bad_words=['#"#'], logprobs=2),
              SamplingParams(temperature=1.0, seed=8, max_tokens=40, min_tokens=30, stop_token_ids=[4], n=2),
              SamplingParams(temperature=0.0, max_tokens=35, frequency_penalty=0.5, logprobs=0),
              SamplingParams(temperature=0.9, seed=2, max_tokens=40, bad_words=["$!"], presence_penalty=0.3)]
    want = llms["ddtree"].generate(prompts, params, use_tqdm=False)
    gb = pool_gb(pair, "ddtree", None, 16, pages=40, page_size=4)
    llm = LLM(model=str(target), draft_model=str(pair.drafter), spec="ddtree", budget=16, device="cpu",
              dtype="float32", max_num_seqs=3, max_model_len=96, page_size=4, kv_cache_memory_gb=gb, overlap=overlap)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.stats.preemptions > 0
    for g, w in zip(got, want):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
        for a, b in zip(g.outputs, w.outputs):
            assert (a.cumulative_logprob is None) == (b.cumulative_logprob is None)
            if a.logprobs is not None:
                assert [list(e) for e in a.logprobs] == [list(e) for e in b.logprobs]
    eng = llm.engine
    assert eng.free_pages == eng.pool.usable and all(r == 0 for r in eng.pool.ref)
    llm.shutdown()


# -- log-probabilities ----------------------------------------------------------------------------

def check_logprobs(out, prompt: list[int], logits: torch.Tensor, k: int) -> None:
    """out's logprobs against log_softmax of the transformers logits of prompt + output."""
    lsm = torch.log_softmax(logits.double(), -1)
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids)
    total = 0.0
    for j, (t, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        row = lsm[len(prompt) - 1 + j]
        assert next(iter(entry)) == t   # the token's own entry first
        assert abs(entry[t].logprob - row[t]) < 1e-4, (j, entry[t], float(row[t]))
        assert entry[t].rank == int((row > row[t]).sum()) + 1
        top = row.topk(k).indices.tolist()
        for i in top:
            assert i in entry and abs(entry[i].logprob - row[i]) < 1e-4
        assert len(entry) == k + (t not in top)
        total += entry[t].logprob
    assert c.cumulative_logprob == pytest.approx(total, abs=1e-9)


@pytest.mark.parametrize("shape", SHAPES)
def test_logprobs_are_the_targets_own_whichever_method_commits(models, hf_model, shape):
    """The committed tokens' log-probabilities (with penalties and a temperature changing the
    picks: the values are the raw distribution's, vLLM's default) equal transformers' log-softmax
    within fp32's tolerance, under plain decoding, DFlash and DDTree alike."""
    target, llms = models(shape)
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=3, repetition_penalty=1.4),
              SamplingParams(temperature=0.7, seed=5, max_tokens=MAX_TOKENS, logprobs=0),
              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=20)]   # more than the vocabulary
    got = {m: llm.generate(PROMPTS, params, use_tqdm=False) for m, llm in llms.items()}
    model = hf_model(target)
    for p, sp, out in zip(PROMPTS, params, got["none"]):
        check_logprobs(out, p, hf_logits(model, p + out.token_ids), min(sp.logprobs, V))
    tok = llms["none"].get_tokenizer()
    first = got["none"][0].outputs[0].logprobs[0]
    assert all(lp.decoded_token == tok.decode([i]) for i, lp in first.items())
    for m in ("dflash", "ddtree"):
        for a, b in zip(got[m], got["none"]):
            assert a.token_ids == b.token_ids
            for ea, eb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                assert list(ea) == list(eb) and [x.rank for x in ea.values()] == [x.rank for x in eb.values()]
                for i in ea:   # fp32: the forwards' widths differ (a decode, a tree), their sums' order too
                    assert ea[i].logprob == pytest.approx(eb[i].logprob, rel=1e-5, abs=1e-5)
    assert got["none"][0].outputs[0].logprobs is not None and got["none"][0].prompt_logprobs is None


def test_prompt_logprobs_from_the_prefill(models, hf_model, tmp_path):
    """prompt_logprobs: None for the first token, then each prompt token's log-probability, rank
    and the k most likely tokens', as transformers gives them; the same in chunks of a longer
    prompt (a small prefill_chunk) and when the prompt's pages were cached by a request before."""
    target, llms = models("qwen3")
    model = hf_model(target)
    prompt = (PROMPTS[1] * 4)[:40]
    lsm = torch.log_softmax(hf_logits(model, prompt).double(), -1)
    chunked = LLM(model=str(target), spec="none", device="cpu", dtype="float32", max_num_seqs=2, max_model_len=96,
                  prefill_chunk=16, page_size=4)
    sp = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    for llm in (llms["none"], chunked, chunked):   # the last: its prompt's pages are in the prefix cache
        (out,) = llm.generate([prompt], sp, use_tqdm=False)
        lps = out.prompt_logprobs
        assert len(lps) == len(prompt) and lps[0] is None
        for j in range(1, len(prompt)):
            row, t = lsm[j - 1], prompt[j]
            assert abs(lps[j][t].logprob - row[t]) < 1e-4 and lps[j][t].rank == int((row > row[t]).sum()) + 1
            for i in row.topk(2).indices.tolist():
                assert abs(lps[j][i].logprob - row[i]) < 1e-4
        assert out.outputs[0].logprobs is None
    chunked.shutdown()


# -- n choices ------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["none", "ddtree"])
def test_n_choices_in_index_order_each_as_its_seed(models, method):
    """n = 3 sampled choices come back in index order; choice i is the request alone with
    seed + i (vLLM's derivation), with its own log-probabilities; greedy choices are equal."""
    _, llms = models("qwen3")
    llm = llms[method]
    sp = SamplingParams(temperature=1.0, seed=40, max_tokens=12, n=3, logprobs=1, presence_penalty=0.5)
    (out,) = llm.generate([PROMPTS[1]], sp, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    alone = [llms["none"].generate([PROMPTS[1]], dataclasses.replace(sp, n=1, seed=40 + i), use_tqdm=False)[0]
             for i in range(3)]
    assert [c.token_ids for c in out.outputs] == [a.token_ids for a in alone]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c, a in zip(out.outputs, alone):
        assert c.cumulative_logprob == pytest.approx(a.outputs[0].cumulative_logprob, abs=1e-4)
    (g,) = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=8, n=2, best_of=2), use_tqdm=False)
    assert g.outputs[0].token_ids == g.outputs[1].token_ids and [c.index for c in g.outputs] == [0, 1]


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_n_choices_share_the_prompts_pages(models, caching):
    """The choices of a request hold the same pages for the prompt's full pages (each page's
    reference count n), whether or not prefix caching is on; the prompt is computed once; the
    pool is whole again when they end."""
    target, _ = models("qwen3")
    llm = LLM(model=str(target), spec="none", device="cpu", dtype="float32", max_num_seqs=4, max_model_len=96,
              page_size=4, enable_prefix_caching=caching)
    eng = llm.engine
    prompt = PROMPTS[1] * 2   # 22 tokens: 5 full pages before the last token's
    seq = eng.add_request(prompt, SamplingParams(temperature=1.0, seed=1, max_tokens=6, n=3, ignore_eos=True))
    while not all(c.row >= 0 for c in seq.choices):
        eng.step()
    pages = [c.pages[:5] for c in seq.choices]
    assert pages[0] == pages[1] == pages[2] and all(eng.pool.ref[p] == 3 for p in pages[0])
    assert len(set(seq.choices[0].pages[5:]) & set(seq.choices[1].pages[5:])) == 0
    assert [c.cached_tokens for c in seq.choices] == [0, 20, 20]
    while eng.has_unfinished():
        eng.step()
    assert all(len(c.output_ids) == 6 for c in seq.choices)
    assert eng.free_pages == eng.pool.usable and all(r == 0 for r in eng.pool.ref)
    # a prompt without a full page to share: the choices start together, none waits for another
    short = eng.add_request(PROMPTS[0][:4], SamplingParams(temperature=1.0, max_tokens=3, n=3, ignore_eos=True))
    eng.step()
    assert all(c.row >= 0 for c in short.choices)
    llm.shutdown()


def test_aborting_a_request_ends_every_choice(models):
    target, _ = models("qwen3")
    llm = LLM(model=str(target), spec="none", device="cpu", dtype="float32", max_num_seqs=4, max_model_len=96,
              page_size=4)
    eng = llm.engine
    seq = eng.add_request(PROMPTS[1], SamplingParams(temperature=1.0, max_tokens=30, n=3, ignore_eos=True))
    eng.step()
    eng.step()
    eng.abort(seq)
    assert all(c.finish_reason == "abort" for c in seq.choices)
    assert not eng.has_unfinished() and eng.free_pages == eng.pool.usable
    llm.shutdown()


# -- refusals -------------------------------------------------------------------------------------

REFUSED = [
    ({"logit_bias": {V: 1.0}}, "logit_bias", "outside the vocabulary"),
    ({"allowed_token_ids": [0, V + 3]}, "allowed_token_ids", "outside the vocabulary"),
    ({"bad_words": [f"{chr(33 + i % 8)}{chr(33 + i // 8)}" for i in range(65)]}, "bad_words", "a request may have 64"),
    ({"bad_words": ["!" * 17]}, "bad_words", "at most 16"),
    ({"best_of": 3, "n": 2}, "best_of", "only None or n (2)"),
    ({"allowed_token_ids": [2, 4], "bad_words": ["!", "#"]}, "bad_words", "ban every token allowed_token_ids allows"),
    ({"allowed_token_ids": [7], "stop_token_ids": [7], "min_tokens": 2}, "min_tokens", "no token could be picked"),
]


@pytest.mark.parametrize("kw,param,says", REFUSED, ids=[r[1] + "-" + r[2][:12] for r in REFUSED])
def test_what_cannot_be_applied_is_refused_naming_it(models, kw, param, says):
    from drafttree.sampling import ParamError

    _, llms = models("qwen3")
    eng = llms["none"].engine
    with pytest.raises(ParamError) as e:
        eng.add_request([1, 2], SamplingParams(max_tokens=4, **kw))
    assert e.value.param == param and says in str(e.value)
    assert not eng.has_unfinished()


def test_a_refused_prompt_of_a_batch_queues_none_of_it(models):
    """generate checks every request's token ids against the vocabulary before queueing any."""
    from drafttree.sampling import ParamError

    _, llms = models("qwen3")
    llm = llms["none"]
    with pytest.raises(ParamError, match="outside the vocabulary"):
        llm.generate([[1, 2], [3, 4]], [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, logit_bias={V: 1})],
                     use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_bad_words_need_a_tokenizer(tmp_path):
    from drafttree.sampling import ParamError

    target = make_target(tmp_path / "t", "qwen3", vocab=V)
    llm = LLM(model=str(target), spec="none", device="cpu", dtype="float32", max_num_seqs=1, max_model_len=32)
    with pytest.raises(ParamError, match="bad_words needs the model's tokenizer"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=2, bad_words=["x"]), use_tqdm=False)
    llm.shutdown()


# -- the GPU: bit for bit, from the processed steps' graphs ----------------------------------------

@pytest.mark.parametrize("dtype", [gpu("bfloat16")])
def test_logprobs_bit_for_bit_from_graphs_in_deterministic_mode(tmp_path, dtype):
    """On CUDA with graphs and --deterministic: processed rounds (penalties, bad words, logprobs)
    replay their captured graphs (no eager fallback), DFlash and DDTree commit plain decoding's
    tokens and give its log-probabilities bit for bit, in bf16."""
    target = make_target(tmp_path / "t", "qwen3", vocab=61, scale=3.0)   # the deterministic kernels' shapes
    write_tokenizer(target, 61)
    drafter = make_drafter(tmp_path / "d", target, block_size=4)
    params = [SamplingParams(temperature=0.0, max_tokens=24, logprobs=5, repetition_penalty=1.3, bad_words=["#$"]),
              SamplingParams(temperature=0.8, seed=3, max_tokens=24, logprobs=2, frequency_penalty=0.5, min_p=0.05),
              SamplingParams(temperature=0.0, max_tokens=24, logprobs=20, logit_bias={2: 1.5}, min_tokens=6,
                             stop_token_ids=[4])]
    got = {}
    for m, (spec, budget) in METHODS.items():
        llm = LLM(model=str(target), draft_model=None if spec is None else str(drafter), spec=spec or "none",
                  budget=budget, device="cuda", dtype=dtype, deterministic=True, max_num_seqs=4, max_model_len=128)
        got[m] = llm.generate(PROMPTS, params, use_tqdm=False)
        assert llm.engine.runner.counters().graph_fallbacks == 0, m
        llm.shutdown()
    assert max(t for o in got["ddtree"] for t in o.metrics["accept_lengths"]) >= 2
    for m in ("dflash", "ddtree"):
        for a, b in zip(got[m], got["none"]):
            assert a.token_ids == b.token_ids, m
            assert [[(i, x.logprob, x.rank) for i, x in e.items()] for e in a.outputs[0].logprobs] == \
                [[(i, x.logprob, x.rank) for i, x in e.items()] for e in b.outputs[0].logprobs], m
