"""Log-probabilities, n choices and the per-logit parameters through the server and the official
openai client (a tiny random model with a character tokenizer, DDTree at a fixed budget, CPU):
chat `logprobs`/`top_logprobs`, completions `logprobs` with `echo`, `n`, penalties, `logit_bias`
with OpenAI's string keys, `seed`, `stop`, vLLM's `prompt_logprobs`; streamed and not, each
equal to the Python API's plain decoding of the same request."""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

httpx = pytest.importorskip("httpx", reason="the tests' HTTP client (the `test` extra)")
openai = pytest.importorskip("openai", reason="the tests' OpenAI client (the `test` extra)")
pytest.importorskip("uvicorn", reason="the server runs on uvicorn")

from drafttree import LLM, SamplingParams  # noqa: E402
from drafttree.engine.engine import Engine, EngineConfig  # noqa: E402
from tests.server_helpers import Live, serve  # noqa: E402
from tests.tiny import make_drafter, make_target, write_tokenizer  # noqa: E402

V = 128   # printable ASCII, then fillers
NAME = "tiny"
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
HI = [{"role": "user", "content": "Say it!"}]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("logits-server")
    t = write_tokenizer(make_target(root / "target", "qwen3", vocab=V, scale=3.0), V, chat_template=TEMPLATE)
    return t, make_drafter(root / "drafter", t, block_size=4)


@pytest.fixture(scope="module")
def live(target) -> Iterator[Live]:
    t, d = target
    engine = Engine(EngineConfig(model=str(t), draft_model=str(d), spec="ddtree", budget=8, device="cpu",
                                 dtype="float32", max_num_seqs=4, max_model_len=160))
    with serve(engine, NAME) as lv:
        yield lv


@pytest.fixture(scope="module")
def plain(target) -> LLM:
    """The same model decoding plainly through the Python API: what every answer must equal."""
    return LLM(model=str(target[0]), spec="none", device="cpu", dtype="float32", max_num_seqs=4, max_model_len=160)


@pytest.fixture(scope="module")
def client(live: Live):
    return live.client()


def close(a: float, b: float) -> bool:
    return a == pytest.approx(b, rel=1e-5, abs=1e-5)


def check_entries(got: list[tuple[str, float, list[tuple[str, float]]]], want, k: int, text) -> None:
    """Per token: its text, its log-probability and its k most likely tokens' (by rank), against
    a CompletionOutput's (want: token ids and their logprobs entries)."""
    ids, entries = want
    assert len(got) == len(ids)
    for (tok, lp, top), t, entry in zip(got, ids, entries):
        assert tok == text(t) and close(lp, entry[t].logprob)
        expect = sorted(((x.rank, text(i), x.logprob) for i, x in entry.items() if x.rank <= k))
        assert [s for s, _ in top] == [s for _, s, _ in expect] and len(top) == k
        assert all(close(a, b) for (_, a), (_, _, b) in zip(top, expect))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_logprobs_choices_and_penalties(client, plain, stream):
    """n = 2 seeded choices with penalties and a logit_bias: each choice's content and
    logprobs.content (the token, its log-probability and the top 3) are the Python API's for
    the same request (choice i: seed + i), streamed or not."""
    kw = dict(model=NAME, messages=HI, max_tokens=10, temperature=0.9, seed=21, n=2, logprobs=True, top_logprobs=3,
              presence_penalty=0.6, frequency_penalty=0.2, logit_bias={"101": 3.0, "32": -100})
    prompt = plain.get_tokenizer().apply_chat_template(HI, tokenize=False, add_generation_prompt=True)
    want = plain.generate([prompt], SamplingParams(temperature=0.9, seed=21, n=2, max_tokens=10, logprobs=3,
                                                   presence_penalty=0.6, frequency_penalty=0.2,
                                                   logit_bias={101: 3.0, 32: -100.0}), use_tqdm=False)[0]
    if not stream:
        r = client.chat.completions.create(**kw)
        got = {c.index: (c.message.content, [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs])
                                             for e in c.logprobs.content], c.finish_reason) for c in r.choices}
        assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 20
    else:
        got = {0: ["", [], None], 1: ["", [], None]}
        for ch in client.chat.completions.create(stream=True, **kw):
            for c in ch.choices:
                g = got[c.index]
                g[0] += c.delta.content or ""
                g[1] += [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs])
                         for e in (c.logprobs.content if c.logprobs else [])]
                g[2] = c.finish_reason or g[2]
    text = plain.get_tokenizer().decode
    one = lambda t: text([t])  # noqa: E731
    for i, c in enumerate(want.outputs):
        content, entries, finish = got[i]
        assert content == c.text and finish == c.finish_reason == "length"
        assert "".join(e[0] for e in entries) == c.text and " " not in c.text   # the bias's -100
        check_entries(entries, (c.token_ids, c.logprobs), 3, one)
    assert want.outputs[0].token_ids != want.outputs[1].token_ids


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completions_logprobs_with_echo_as_lm_eval_asks(client, plain, stream):
    """lm-eval's loglikelihood request (a token-id prompt, echo, logprobs 1, max_tokens 1,
    temperature 0): the prompt's tokens first (the first without a log-probability) with the
    prefill's log-probabilities, then the generated token's; text offsets run over the echoed
    text. Token ids in, streamed or not."""
    tok = plain.get_tokenizer()
    ids = tok.encode("The cat sat on the mat", add_special_tokens=False)
    want = plain.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, logprobs=1, prompt_logprobs=1),
                          use_tqdm=False)[0]
    kw = dict(model=NAME, prompt=[ids], max_tokens=1, temperature=0, logprobs=1, echo=True, seed=1234)
    if not stream:
        (c,) = client.completions.create(**kw).choices
        text, lp = c.text, c.logprobs
        tokens, token_lps, tops, offsets = lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset
    else:
        text, tokens, token_lps, tops, offsets = "", [], [], [], []
        for ch in client.completions.create(stream=True, **kw):
            for c in ch.choices:
                text += c.text
                if c.logprobs:
                    tokens += c.logprobs.tokens
                    token_lps += c.logprobs.token_logprobs
                    tops += c.logprobs.top_logprobs
                    offsets += c.logprobs.text_offset
    prompt_text = tok.decode(ids)
    assert text == prompt_text + want.text
    assert tokens == [tok.decode([t]) for t in ids + want.token_ids]
    assert offsets == [len("".join(tokens[:j])) for j in range(len(tokens))]
    assert token_lps[0] is None and tops[0] is None
    expect = [want.prompt_logprobs[j][t].logprob for j, t in enumerate(ids) if j] + \
        [want.outputs[0].logprobs[0][want.token_ids[0]].logprob]
    assert all(close(a, b) for a, b in zip(token_lps[1:], expect)) and len(token_lps) == len(ids) + 1
    # the generated token is greedy: its log-probability is the largest of its top ones (lm-eval's is_greedy)
    assert token_lps[-1] == max(tops[-1].values())


def test_completions_n_seed_stop_and_penalties(client, plain):
    """Three seeded choices with a repetition penalty and a stop string; each equals the Python
    API's choice; streamed, the pieces of each index add up to the same."""
    kw = dict(model=NAME, prompt="abc", max_tokens=12, temperature=1.0, seed=5, n=3, stop=["q"],
              extra_body={"repetition_penalty": 1.3, "min_p": 0.05})
    want = plain.generate(["abc"], SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=12, stop=["q"],
                                                  repetition_penalty=1.3, min_p=0.05), use_tqdm=False)[0]
    r = client.completions.create(**kw)
    assert [(c.index, c.text, c.finish_reason) for c in r.choices] == \
        [(c.index, c.text, c.finish_reason) for c in want.outputs]
    pieces: dict[int, str] = {}
    for ch in client.completions.create(stream=True, **kw):
        for c in ch.choices:
            pieces[c.index] = pieces.get(c.index, "") + c.text
    assert pieces == {c.index: c.text for c in want.outputs}


def post(live: Live, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{live.url}{path}", content=json.dumps({"model": NAME, **body}).encode(),
                      headers={"Content-Type": "application/json"}, timeout=60)


def test_prompt_logprobs_vllms_field(live, plain):
    """vLLM's prompt_logprobs: per prompt token, None first, then {id: {logprob, rank,
    decoded_token}}; on completions in each choice, on chat beside the choices; refused streamed."""
    want = plain.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2),
                          use_tqdm=False)[0]
    r = post(live, "/v1/completions", {"prompt": "hello", "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(want.prompt_logprobs)
    for g, w in zip(got[1:], want.prompt_logprobs[1:]):
        assert set(g) == {str(i) for i in w}
        assert all(close(g[str(i)]["logprob"], x.logprob) and g[str(i)]["rank"] == x.rank for i, x in w.items())
    r = post(live, "/v1/chat/completions", {"messages": HI, "max_tokens": 2, "prompt_logprobs": 0})
    assert r.status_code == 200 and r.json()["prompt_logprobs"][0] is None
    r = post(live, "/v1/completions", {"prompt": "hello", "max_tokens": 2, "prompt_logprobs": 1, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


REFUSED = [
    ("/v1/completions", {"logit_bias": {"x1": 1.0}}, "logit_bias", "keys must be token ids"),
    ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias", "numbers in [-100, 100]"),
    ("/v1/completions", {"logit_bias": {str(V): 1}}, "logit_bias", "outside the vocabulary"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    ("/v1/completions", {"logprobs": 21}, "logprobs", "[0, 20]"),
    ("/v1/completions", {"n": 2, "best_of": 3}, "best_of", "only None or n (2)"),
    ("/v1/chat/completions", {"n": 0}, "n", "an integer >= 1"),
    ("/v1/completions", {"allowed_token_ids": [1, 1000]}, "allowed_token_ids", "outside the vocabulary"),
    ("/v1/completions", {"min_tokens": 5, "max_tokens": 2}, "min_tokens", "at most max_tokens"),
]


@pytest.mark.parametrize("path,body,param,says", REFUSED, ids=[f"{r[2]}-{r[3][:10]}" for r in REFUSED])
def test_what_cannot_be_applied_is_a_400_naming_it(live, path, body, param, says):
    where = {"messages": HI} if "chat" in path else {"prompt": "hi"}
    r = post(live, path, {"max_tokens": 2, **where, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"], err
