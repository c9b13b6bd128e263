"""Reasoning models (`<think>` reasoning `</think>` answer, `reasoning_parser`): the output's two
parts read off its token ids, whole and while it streams; whether the prompt opened the reasoning;
a structured output that holds from the reasoning's end on (every kind of constraint, no end of
sequence inside the reasoning); and on a tiny random model, speculative decoding under such a
constraint equal to plain decoding token for token, the answer valid."""
from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("llguidance", reason="structured outputs run on llguidance (a dependency)")

from drafttree import LLM, SamplingParams  # noqa: E402
from drafttree.server.reasoning import ReasoningStream  # noqa: E402
from drafttree.structured.grammar import GrammarCompiler  # noqa: E402
from drafttree.structured.params import AfterReasoning, StructuredOutputs  # noqa: E402
from drafttree.structured.reasoning import PartsReader, Reasoning, reply_parts  # noqa: E402
from tests.tiny import make_drafter, make_target, write_tokenizer  # noqa: E402

VOCAB = 128
EOS = "<extra_0>"
MARKERS = ("<|tool_calls_section_begin|>", "<think>", "</think>")
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["a"], "additionalProperties": False}


@pytest.fixture(scope="module", params=[False, True], ids=["markers", "special-markers"])
def tok(request, tmp_path_factory):
    from transformers import AutoTokenizer
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d, VOCAB, eos_token=EOS, added=MARKERS, special=request.param)
    return AutoTokenizer.from_pretrained(str(d))


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_the_parts_are_read_off_the_token_ids(tok):
    r = Reasoning("qwen3", tok)
    split = r.split(ids(tok, "<think>hm, ok</think>  yes"), "free")
    assert tok.decode(split.reasoning) == "hm, ok" and tok.decode(split.answer) == "  yes" and split.ended
    split = r.split(ids(tok, "hm</think>yes"), "open")   # the prompt opened it
    assert tok.decode(split.reasoning) == "hm" and tok.decode(split.answer) == "yes"
    split = r.split(ids(tok, "still thinking"), "open")
    assert tok.decode(split.reasoning) == "still thinking" and not split.answer and not split.ended
    assert r.split(ids(tok, "yes <think>no</think>"), "free").reasoning is None   # not at the start: content
    assert r.split(ids(tok, "<think>no</think>"), "closed").reasoning is None      # the prompt closed it
    assert r.split([], "free").reasoning is None
    # Kimi K2 may begin its tool calls without closing the reasoning; the calls are the answer's
    k = Reasoning("kimi_k2", tok)
    split = k.split(ids(tok, "hm<|tool_calls_section_begin|>x"), "open")
    assert tok.decode(split.reasoning) == "hm" and split.answer == ids(tok, "<|tool_calls_section_begin|>x")
    assert r.split(ids(tok, "hm<|tool_calls_section_begin|>x"), "open").ended is False


@pytest.mark.parametrize("prompt, state", [
    ("user: hi | assistant: <think>", "open"),
    ("user: hi | assistant: <think></think>  ", "closed"),      # thinking turned off by the template
    ("user: hi | assistant: ", "free"),
    ("assistant: <think>a</think>b | user: hi | assistant: <think>", "open"),
    ("assistant: <think>a</think>b | user: hi | assistant: ", "free"),
])
def test_the_prompt_says_where_it_left_the_reasoning(tok, prompt, state):
    r = Reasoning("deepseek_r1", tok)
    assert r.state(prompt) == state and r.state(ids(tok, prompt)) == state


def test_a_parser_the_model_cannot_write_is_refused(tmp_path):
    from transformers import AutoTokenizer
    plain = AutoTokenizer.from_pretrained(str(write_tokenizer(tmp_path, VOCAB, eos_token=EOS)))
    with pytest.raises(ValueError, match=r"reasoning parser qwen3: .*'<think>' as 7 tokens"):
        Reasoning("qwen3", plain)
    with pytest.raises(ValueError, match="unknown reasoning parser 'r2'"):
        Reasoning("r2", plain)


@pytest.mark.parametrize("stops", [(), ("zz",)])
def test_streamed_reasoning_adds_up_to_the_whole(tok, stops):
    r = Reasoning("qwen3", tok)
    eos = {tok.convert_tokens_to_ids(EOS)}
    text = "<think> let me see: 2 + 2 </think>  The answer is 4." + ("zz and more" if stops else "")
    out = ids(tok, text)
    finish = "stop"
    whole = reply_parts(tok, r, out, "free", eos, stops, finish)
    assert whole.reasoning == "let me see: 2 + 2" and whole.content.startswith("The answer is 4.")
    if stops:
        assert whole.content == "The answer is 4."
    stream, sent = ReasoningStream(PartsReader(tok, r, "free", eos, marked_without=frozenset())), ""
    for n in range(1, len(out) + 1):
        parts = stream.reader.read(out[:n], stops, finish if n == len(out) else None)   # decoded a window at a time
        for d in stream.deltas(parts, n == len(out), hold=max((len(s) for s in stops), default=1) - 1):
            assert d["reasoning_content"] == d["reasoning"]
            sent += d["reasoning"]
        assert whole.reasoning.startswith(sent)   # never more than the whole, trailing whitespace held
    assert sent == whole.reasoning and (parts.content, parts.marked) == (whole.content, whole.content)
    # a reply cut inside its reasoning: the reasoning so far, no content
    cut = reply_parts(tok, r, out[:8], "free", eos, stops, "length")
    assert cut.reasoning == "let me" and cut.content == "" and not cut.ended


def test_the_answers_constraint_starts_after_the_reasoning(tok):
    eos = tok.convert_tokens_to_ids(EOS)
    compiler = GrammarCompiler(tok, VOCAB, {eos})
    r = Reasoning("kimi_k2", tok)
    forms = {"json": (StructuredOutputs(json=SCHEMA), '{"a": 7}', '{"b": 7}'),
             "json_object": (StructuredOutputs(json_object=True), '{"x": [1]}', "[1]"),
             "regex": (StructuredOutputs(regex="[a-c]{3}"), "abc", "abd"),
             "choice": (StructuredOutputs(choice=("yes", "no")), "no", "maybe"),
             "lark": (StructuredOutputs(grammar='start: "x" "y"+'), "xyy", "yx"),
             "gbnf": (StructuredOutputs(grammar='root ::= "x" [0-9]'), "x5", "xx")}
    for name, (so, good, bad) in forms.items():
        for state in ("open", "free"):
            opened = state == "open"
            gated = StructuredOutputs(**{so.kind: getattr(so, so.kind)}, after_reasoning=r.constraint(state))
            head = "" if opened else "<think>"

            def takes(text: str, end: bool = True) -> bool:
                m = compiler.matcher(gated)
                want = ids(tok, text) + ([eos] if end else [])
                return m.advance(want) == len(want)
            assert takes(f"{head}a {{not json}} </think>  {good}"), (name, opened)
            assert not takes(f"{head}thought</think>{bad}"), (name, opened)
            assert not takes(f"{head}thought"), "the reasoning ended the output"
            assert not takes(f"{head}thought<|tool_calls_section_begin|></think>{good}"), "a marker ended the reasoning"
            assert takes(good) is (not opened), (name, opened)   # no reasoning at all: only where free
    assert r.constraint("closed") is None   # the prompt closed the reasoning: the constraint from the first token


def test_after_reasoning_names_its_tokens():
    with pytest.raises(ValueError, match="two token ids"):
        AfterReasoning(5, 5, True)
    so = StructuredOutputs(json_object=True, after_reasoning={"start": 1, "end": 2, "opened": False})
    assert so.after_reasoning == AfterReasoning(1, 2, False) and so.key() != StructuredOutputs(json_object=True).key()


# -- on a tiny random model ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("reasoning")
    target = write_tokenizer(make_target(root / "target", "qwen3", vocab=VOCAB, scale=3.0), VOCAB, eos_token=EOS,
                             added=MARKERS)
    return target, make_drafter(root / "drafter", target, block_size=4)


def engine(pair, spec: str, budget: int | None = None, reasoning: str | None = "qwen3") -> LLM:
    target, drafter = pair
    return LLM(model=str(target), draft_model=None if spec == "none" else str(drafter), spec=spec, budget=budget,
               device="cpu", dtype="float32", max_num_seqs=4, max_model_len=200, reasoning_parser=reasoning)


def requests(end: int) -> tuple[list[str], list[SamplingParams]]:
    """Reasoning opened by the prompt and not, JSON and regex answers, and a free request; the
    end marker favoured so that a random model's reasoning ends within the tokens given (and spaces
    not, which a JSON answer could take forever)."""
    bias = {end: 3.0, 1: -5.0}
    schema, regex = StructuredOutputs(json=SCHEMA), StructuredOutputs(regex="[a-z]{2,4}-[0-9]{2}")
    params = [SamplingParams(temperature=0, max_tokens=96, logit_bias=bias, structured_outputs=schema),
              SamplingParams(temperature=0, max_tokens=96, logit_bias=bias, structured_outputs=regex),
              SamplingParams(temperature=0, max_tokens=96, logit_bias={**bias, end - 1: 6.0},
                             structured_outputs=schema),
              SamplingParams(temperature=0, max_tokens=16)]
    return ["hello <think>", "abc <think>", "q: ", "xyz"], params


@pytest.mark.parametrize("spec,budget", [("ddtree", 8), ("dflash", None)])
def test_speculation_under_a_constraint_after_reasoning_equals_plain(pair, spec, budget):
    plain = engine(pair, "none")
    tok = plain.engine.tokenizer
    r = plain.engine.text.reasoning
    prompts, params = requests(r.end_id)
    want = plain.generate(prompts, params)
    for i, (prompt, w) in enumerate(zip(prompts[:3], want)):
        parts = reply_parts(tok, r, w.token_ids, r.state(prompt), plain.engine.eos_ids, (), w.finish_reason)
        assert parts is not None and parts.ended and parts.reasoning, (i, w.text)
        assert w.finish_reason == "stop", (i, w.text)
        if i == 1:
            assert re.fullmatch("[a-z]{2,4}-[0-9]{2}", parts.content), parts.content
        else:
            assert set(json.loads(parts.content)) == {"a"}
    llm = engine(pair, spec, budget)
    got = llm.generate(prompts, params)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason, (g.text, w.text)
    times = llm.engine.constrained.times
    assert 0 < times.thought_trees, "no tree grown inside a reasoning without the grammar's matchers"
    if spec == "ddtree":   # trees of the reasoning and the answer had drafts accepted
        assert max(t for o in got[:3] for t in o.metrics["accept_lengths"]) >= 2


def test_a_reasoning_under_a_constraint_has_one_mask_and_one_after_its_end(pair):
    """Inside a reasoning the constraint leaves free, every position has the same mask (the
    reasoning's), and after its end the answer's grammar starts in one state whatever the
    reasoning held: `Thought`'s two masks are llguidance's at those states; the matcher's phase
    follows the committed tokens (a reasoning that may open opens only with its first token)."""
    import numpy as np

    llm = engine(pair, "none")
    r, compiler = llm.engine.text.reasoning, llm.engine.constrained.compiler
    ids = llm.engine.tokenizer.encode("some thinking", add_special_tokens=False)

    def mask_of(m) -> np.ndarray:
        out = np.empty((1, compiler.words), dtype=np.int32)
        compiler.fill_raw_masks([(m, 0)], out)
        return out[0]
    for opened in (True, False):
        m = compiler.matcher(StructuredOutputs(json=SCHEMA, after_reasoning=r.constraint("open" if opened else "free")))
        if not opened:
            assert m.phase == "before" and m.thought() is None
            assert m.advance([r.start_id]) == 1
        t = m.thought()
        assert m.phase == "in" and t is not None and t.allowed[ids[0]] and not t.allowed[sorted(compiler.eos_ids)[0]]
        assert m.advance(ids) == len(ids)
        assert (mask_of(m.m) == t.mask).all() and m.thought() is t
        after = m.m.deep_copy()
        after.consume_token(r.end_id)
        assert (mask_of(after) == t.after_end).all()
        assert m.advance([r.end_id]) == 1 and m.phase is None and m.thought() is None
    free = compiler.matcher(StructuredOutputs(json=SCHEMA, after_reasoning=r.constraint("free")))
    assert free.advance([ord("{") - 31]) == 1 and free.phase is None, "an answer begun without the reasoning"


def test_without_the_parser_the_constraint_holds_from_the_first_token(pair):
    prompts, params = requests(VOCAB - 1)
    out = engine(pair, "none", reasoning=None).generate(prompts[:1], params[:1])[0]
    assert set(json.loads(out.text)) == {"a"}


def test_kimi_k2_tool_calls_after_the_reasoning_are_parsed(tok):
    from drafttree.server.tool_parsers import make_parser
    from drafttree.server.tools import ToolPlan
    r = Reasoning("kimi_k2", tok)
    call = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
            '{"x": 1}<|tool_call_end|><|tool_calls_section_end|>')
    tools = [{"type": "function", "function": {"name": "f"}}]
    for reply in ("I should call f." + call, "I should call f.</think>" + call):   # closed or not
        parts = reply_parts(tok, r, ids(tok, reply), "open", set(), (), "stop", marked_without=frozenset())
        assert parts.reasoning == "I should call f." and parts.ended
        message, finish = ToolPlan(tools, make_parser(tok, "kimi_k2"), None, True, False).reply(parts.marked, "stop")
        assert finish == "tool_calls" and message["content"] is None
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == \
            [("f", {"x": 1})]


def test_a_tool_replys_text_keeps_its_formats_markers_and_no_other_special_token(tok):
    """The text a tool reply is parsed from, whole and streamed: plain text (special tokens left
    out) but for the format's markers, so that streamed content equals the whole reply's."""
    from drafttree.server.tool_parsers import make_parser
    hidden = make_parser(tok, "kimi_k2").hidden_ids()
    out = ids(tok, "a<think>b</think>c<|tool_calls_section_begin|>d")
    kept = tok.decode([t for t in out if t not in hidden], skip_special_tokens=False)
    plain = tok.decode(out, skip_special_tokens=True)
    marker = tok.convert_tokens_to_ids("<|tool_calls_section_begin|>")
    assert marker not in hidden and "<|tool_calls_section_begin|>" in kept
    assert kept.replace("<|tool_calls_section_begin|>", "") == plain.replace("<|tool_calls_section_begin|>", "")
    special = tok.added_tokens_decoder[tok.convert_tokens_to_ids("<think>")].special
    assert ("<think>" in kept) is not special
