"""A reasoning model behind the server (`--reasoning-parser`), with the openai client: replies in
two parts (`reasoning_content` and `reasoning`, then `content`) whose streamed deltas add up to the
whole and whose text with the end marker between is the raw completion's; `include_reasoning`;
a JSON schema that holds from the reasoning's end; a template's switch that turns thinking off;
reasoning sent back in the history; a stop token that ends the content (tiny random model, CPU)."""
from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

openai = pytest.importorskip("openai", reason="the tests' OpenAI client (the `test` extra)")
httpx = pytest.importorskip("httpx", reason="the tests' HTTP client (the `test` extra)")
pytest.importorskip("llguidance", reason="structured outputs run on llguidance (a dependency)")

from tests.server_helpers import MODEL, Live, cpu_engine, serve  # noqa: E402
from tests.tiny import make_drafter, make_target, write_tokenizer  # noqa: E402

VOCAB = 128
EOS = "<extra_0>"
# a template that opens the reasoning unless `thinking` is false, and keeps earlier turns' reasoning
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
            "</think>{% endif %}{{ m['content'] }} | {% endfor %}{% if add_generation_prompt %}assistant: "
            "{% if thinking is defined and not thinking %}<think></think>{% else %}<think>{% endif %}{% endif %}")
ASK = [{"role": "user", "content": "Think, then answer."}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["a"], "additionalProperties": False}


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[Live]:
    root = tmp_path_factory.mktemp("reasoning_server")
    target = write_tokenizer(make_target(root / "target", "qwen3", vocab=VOCAB, scale=3.0), VOCAB, eos_token=EOS,
                             chat_template=TEMPLATE, added=("<think>", "</think>"))
    drafter = make_drafter(root / "drafter", target, block_size=4)
    with serve(cpu_engine(target, spec="ddtree", budget=8, draft_model=str(drafter), reasoning_parser="qwen3")) as lv:
        yield lv


@pytest.fixture(scope="module")
def client(live: Live):
    return live.client()


END = VOCAB - 1   # </think>
BIAS = {str(END): 3.0, "1": -5.0}   # the reasoning ends soon, and a JSON answer does not take spaces forever


def reply(client, stream: bool, **kw) -> tuple[str | None, str | None, str]:
    """(reasoning, content, finish reason) of one chat reply."""
    kw = {"model": MODEL, "messages": ASK, "max_tokens": 64, "temperature": 0, "logit_bias": BIAS, **kw}
    if not stream:
        c = client.chat.completions.create(**kw).choices[0]
        extra = c.message.model_extra or {}
        assert extra.get("reasoning_content") == extra.get("reasoning")
        return extra.get("reasoning_content"), c.message.content, c.finish_reason
    reasoning, content, finish = None, None, None
    for ch in client.chat.completions.create(stream=True, **kw):
        d = ch.choices[0].delta
        extra = d.model_extra or {}
        assert extra.get("reasoning_content") == extra.get("reasoning")
        if extra.get("reasoning_content"):
            assert content is None, "reasoning after the content"
            reasoning = (reasoning or "") + extra["reasoning_content"]
        if d.content:
            content = (content or "") + d.content
        finish = ch.choices[0].finish_reason or finish
    return reasoning, content, finish


def test_a_reply_comes_in_two_parts_whole_and_streamed(live, client):
    whole = reply(client, False)
    reasoning, content, finish = whole
    assert reasoning and content and finish in ("stop", "length")
    assert reply(client, True) == whole
    # the raw completion of the same prompt is the reasoning, the end marker and the content
    prompt = httpx.post(f"{live.url}/tokenize", json={"messages": ASK}, timeout=30).json()["tokens"]
    raw = httpx.post(f"{live.url}/v1/completions", json={"prompt": prompt, "max_tokens": 64, "temperature": 0,
                                                          "logit_bias": BIAS}, timeout=60).json()
    text = raw["choices"][0]["text"]
    r, _, c = text.partition("</think>")
    assert (r.strip(), c.lstrip()) == (reasoning, content)


@pytest.mark.parametrize("stream", [False, True])
def test_include_reasoning_false_leaves_it_out(client, stream):
    reasoning, content, _ = reply(client, stream, extra_body={"include_reasoning": False})
    assert reasoning is None and content == reply(client, False)[1]


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_holds_from_the_end_of_the_reasoning(client, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}
    reasoning, content, finish = reply(client, stream, response_format=fmt, max_tokens=96)
    assert reasoning and finish == "stop"
    assert set(json.loads(content)) == {"a"}


def test_thinking_turned_off_by_the_template_gives_content_alone(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}
    reasoning, content, _ = reply(client, False, response_format=fmt,
                                  extra_body={"chat_template_kwargs": {"thinking": False}})
    assert reasoning is None and set(json.loads(content)) == {"a"}   # the schema from the first token


def test_reasoning_sent_back_reaches_the_template(live, client):
    history = ASK + [{"role": "assistant", "content": "ok", "reasoning_content": "abc"},
                     {"role": "user", "content": "again"}]
    tokens = httpx.post(f"{live.url}/tokenize", json={"messages": history}, timeout=30).json()["tokens"]
    text = httpx.post(f"{live.url}/detokenize", json={"tokens": tokens}, timeout=30).json()["prompt"]
    assert "assistant: <think>abc</think>ok | " in text
    # the message as a reply gave it (both names) is taken back
    echoed = dict(history[1], reasoning="abc")
    assert reply(client, False, messages=[*ASK, echoed, history[2]], max_tokens=4)[2] == "length"
    for bad in ({"role": "user", "content": "x", "reasoning_content": "y"},
                {"role": "assistant", "content": "x", "reasoning_content": "y", "reasoning": "z"}):
        r = httpx.post(f"{live.url}/v1/chat/completions", json={"messages": [bad], "max_tokens": 2}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


@pytest.mark.parametrize("stream", [False, True])
def test_the_usage_counts_the_reasoning_tokens(client, stream):
    """usage.completion_tokens_details.reasoning_tokens (OpenAI's): the reply's tokens up to its
    answer, the end marker included, whole and in the streamed usage chunk."""
    kw = {"model": MODEL, "messages": ASK, "max_tokens": 64, "temperature": 0, "logit_bias": BIAS}
    if stream:
        usage = [ch.usage for ch in client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                                   **kw) if ch.usage][-1]
    else:
        usage = client.chat.completions.create(**kw).usage
    tokens = [t.token for t in client.chat.completions.create(logprobs=True, **kw).choices[0].logprobs.content]
    assert "</think>" in tokens
    assert usage.completion_tokens_details.reasoning_tokens == tokens.index("</think>") + 1
    assert usage.completion_tokens == len(tokens)


@pytest.mark.parametrize("stream", [False, True])
def test_the_stop_token_that_ends_the_content_leaves_its_text(live, client, stream):
    """As the engine's text of an output (and vLLM's): a stop token id that ends the reply is not
    in its content."""
    reasoning, content, _ = reply(client, False)
    special = set("</think>" + EOS + "0123456789")   # characters of special tokens' text
    c = next(ch for ch in content[1:] if ch.strip() and ch not in reasoning and ch not in special)
    [stop] = httpx.post(f"{live.url}/tokenize", json={"prompt": c}, timeout=30).json()["tokens"]
    again, cut, finish = reply(client, stream, extra_body={"stop_token_ids": [stop]})
    assert (again, cut, finish) == (reasoning, content[:content.index(c)], "stop")
