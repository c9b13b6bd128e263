"""The Python API in vLLM's shape: SamplingParams checked on construction, RequestOutput.outputs,
prompts as vLLM takes them, use_tqdm, an LLM's lifetime, repo ids through the Hugging Face cache,
and settings that cannot take effect refused at start."""
from __future__ import annotations

import logging
import random
from dataclasses import replace
from pathlib import Path

import pytest

from drafttree import LLM, SamplingParams
from drafttree.llm import CompletionOutput, RequestOutput
from drafttree.sampling import NOT_YET, ParamError
from tests.hub_cache import fake_hub_cache
from tests.tiny import make_drafter, make_target, write_tokenizer

ENGINE = {"device": "cpu", "dtype": "float32", "max_num_seqs": 2, "max_model_len": 64}


@pytest.fixture(scope="module")
def textpair(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny random target with a character-level tokenizer (text prompts, stop strings), and a
    drafter for it."""
    root = tmp_path_factory.mktemp("textpair")
    target = write_tokenizer(make_target(root / "target", "qwen3", vocab=97, scale=3.0), 97)
    return target, make_drafter(root / "drafter", target, block_size=4)


@pytest.fixture(scope="module")
def llm(textpair) -> LLM:
    with LLM(model=str(textpair[0]), draft_model=str(textpair[1]), spec="ddtree", budget=4, **ENGINE) as llm:
        yield llm


# the field, a bad value, and what the message says
BAD = [
    ("temperature", "hot", "temperature must be a number in [0, 2]"),
    ("temperature", -0.5, "temperature must be a number in [0, 2]"),
    ("temperature", 2.5, "temperature must be a number in [0, 2]"),
    ("temperature", float("nan"), "temperature must be a number"),
    ("top_p", 0.0, "top_p must be a number in (0, 1]"),
    ("top_p", "1", "top_p must be a number"),
    ("top_k", -2, "top_k must be an integer: -1 or 0 (off), or >= 1"),
    ("top_k", 2.0, "top_k must be an integer"),
    ("top_k", True, "top_k must be an integer"),
    ("seed", 1.5, "seed must be an integer or None"),
    ("max_tokens", 0, "max_tokens must be an integer >= 1"),
    ("max_tokens", 2.5, "max_tokens must be an integer >= 1"),
    ("max_tokens", "10", "max_tokens must be an integer >= 1"),
    ("stop", 5, "stop must be a string or a list of strings"),
    ("stop", ["ok", ""], "stop strings must not be empty"),
    ("stop", "\ud800", "stop[0] is not valid Unicode: a lone surrogate (U+D800)"),
    ("stop_token_ids", [1, -1], "stop_token_ids must be a list of token ids"),
    ("ignore_eos", 1, "ignore_eos must be True or False"),
    ("max_budget", -1, "max_budget must be an integer >= 0"),
    ("n", 0, "n must be an integer >= 1"),
    ("n", True, "n must be an integer >= 1"),
    ("presence_penalty", 2.5, "presence_penalty must be a number in [-2, 2]"),
    ("frequency_penalty", -3.0, "frequency_penalty must be a number in [-2, 2]"),
    ("repetition_penalty", 0.0, "repetition_penalty must be a number > 0"),
    ("logit_bias", {5: 101.0}, "logit_bias must be a mapping of token ids (integers >= 0) to numbers in [-100, 100]"),
    ("logit_bias", {-1: 1.0}, "logit_bias must be a mapping of token ids"),
    ("allowed_token_ids", [], "allowed_token_ids must be a non-empty list of token ids"),
    ("logprobs", 21, "logprobs must be an integer in [0, 20]"),
    ("logprobs", -1, "logprobs must be an integer in [0, 20]"),
    ("prompt_logprobs", 21, "prompt_logprobs must be an integer in [0, 20]"),
    ("min_tokens", -1, "min_tokens must be an integer >= 0"),
    ("min_tokens", 300, "min_tokens (300) must be at most max_tokens (256)"),
    ("min_p", 1.5, "min_p must be a number in [0, 1]"),
    ("bad_words", [" "], "bad_words must be a list of words (non-blank strings)"),
    ("bad_words", ["\ud800"], "bad_words[0] is not valid Unicode"),
    ("best_of", 2, "best_of=2 is not supported yet (only None or n (1))"),
    ("include_stop_str_in_output", 1, "include_stop_str_in_output must be True or False"),
    ("skip_special_tokens", None, "skip_special_tokens must be True or False"),
    ("truncate_prompt_tokens", 0, "truncate_prompt_tokens must be an integer >= 1"),
    ("truncate_prompt_tokens", -2, "truncate_prompt_tokens must be an integer >= 1"),
]


@pytest.mark.parametrize("name,value,says", BAD, ids=[f"{b[0]}={b[1]!r}" for b in BAD])
def test_sampling_params_refuse_a_bad_field_naming_it(name, value, says):
    with pytest.raises(ParamError) as e:
        SamplingParams(**{name: value})
    assert isinstance(e.value, ValueError) and e.value.param == name and says in str(e.value), str(e.value)


def test_sampling_params_take_neutral_values_and_normalize():
    neutral = {"best_of": 1, "logits_processors": []}
    assert set(neutral) <= set(NOT_YET)
    honoured = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1, "logit_bias": {},
                "bad_words": [], "min_p": 0, "min_tokens": 0, "skip_special_tokens": True,
                "include_stop_str_in_output": False, "spaces_between_special_tokens": True,
                "truncate_prompt_tokens": None}
    assert not set(honoured) & set(NOT_YET)
    p = SamplingParams(temperature=1, top_p=1, top_k=-1, seed=3, stop="x", stop_token_ids=(4,), **neutral, **honoured)
    assert (p.temperature, p.stop, p.stop_token_ids) == (1.0, ["x"], [4]) and type(p.temperature) is float
    assert not p.processes_logits and type(p.repetition_penalty) is float
    assert SamplingParams(n=3, best_of=3).best_of == 3   # as many candidates as choices
    assert SamplingParams(max_tokens=None).max_tokens is None


def test_request_output_in_vllms_shape(llm):
    [out] = llm.generate("abc", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert isinstance(out, RequestOutput) and out.finished
    assert out.prompt == "abc" and out.prompt_token_ids == llm.tokenizer.encode("abc", add_special_tokens=False)
    [c] = out.outputs
    assert isinstance(c, CompletionOutput) and c.index == 0 and c.finished()
    assert len(c.token_ids) == 12 and c.text == llm.tokenizer.decode(c.token_ids)
    assert (c.finish_reason, c.stop_reason, c.logprobs, c.cumulative_logprob) == ("length", None, None, None)
    # the first output's fields read directly, as before
    assert (out.token_ids, out.text, out.finish_reason) == (c.token_ids, c.text, c.finish_reason)
    assert out.metrics["rounds"] == len(out.metrics["accept_lengths"]) and out.metrics["ttft_s"] >= 0
    assert out.to_dict()["outputs"][0]["token_ids"] == c.token_ids

    # stop_reason: the stop string or the stop token id that ended the output
    text = c.text
    stop = text[4:6]
    [cut] = llm.generate("abc", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop]),
                         use_tqdm=False)
    assert cut.outputs[0].text == text[:text.find(stop)] and cut.outputs[0].stop_reason == stop
    tok = c.token_ids[3]
    [cut] = llm.generate("abc", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                               stop_token_ids=[tok]), use_tqdm=False)
    assert cut.token_ids == c.token_ids[:c.token_ids.index(tok) + 1]
    assert (cut.finish_reason, cut.outputs[0].stop_reason) == ("stop", tok)


def test_prompts_as_vllm_takes_them_and_bad_ones_lose_nothing(llm):
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    ids = llm.tokenizer.encode("hello", add_special_tokens=False)
    a, b, c = llm.generate([{"prompt": "hello"}, {"prompt_token_ids": ids}, ids], params, use_tqdm=False)
    assert a.token_ids == b.token_ids == c.token_ids and a.prompt == "hello" and b.prompt is None
    bad = [("\ud800", "prompt 1 is not valid Unicode"), (5, "prompt 1 is a int"),
           ({"prompt": "x", "multi_modal_data": {}}, "multi-modal data is not supported"),
           ([], "prompt 1: the prompt is empty"), ("x" * 64, "prompt 1: the prompt has 64 tokens")]
    for prompt, says in bad:
        with pytest.raises(ValueError, match=says.replace("(", r"\(")):
            llm.generate(["ok", prompt], params, use_tqdm=False)
        assert not llm.engine.has_unfinished()   # the good prompt before it was not queued either
    with pytest.raises(ValueError, match="not valid Unicode"):
        llm.chat([{"role": "user", "content": "hi \udfff"}])
    with pytest.raises(ValueError, match="sampling_params\\[0\\] is a dict"):
        llm.generate(["ok"], [{"temperature": 0}])


def test_max_tokens_past_the_context_is_refused_before_any_work(llm):
    """The context holds 64: 60 more tokens after a 5-token prompt is refused at once (it would
    decode until the context is full); None decodes to the context's end."""
    with pytest.raises(ValueError, match="prompt 1: the context holds 64 tokens, but the prompt has 5 and "
                                         "max_tokens asks for 60 more: lower max_tokens to at most 59"):
        llm.generate(["ab", "abcde"], [SamplingParams(max_tokens=4), SamplingParams(max_tokens=60)], use_tqdm=False)
    assert not llm.engine.has_unfinished()
    with pytest.raises(ValueError, match="asks for 1000000000 more"):
        llm.generate("abcde", SamplingParams(max_tokens=10**9), use_tqdm=False)
    [out] = llm.generate("abcde", SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True), use_tqdm=False)
    assert len(out.token_ids) == 64 - 5 and out.finish_reason == "length"


def test_a_stop_string_ends_the_output_at_its_token_as_plain_decoding_does(llm, textpair):
    """A round commits several tokens: the output ends at the one that completes a stop string
    (token ids, text and log-probabilities as plain decoding's), not at the round's last."""
    with LLM(model=str(textpair[0]), spec="none", **ENGINE) as plain:
        tried, rng = 0, random.Random(0)
        for _ in range(40):
            prompt = [rng.randrange(1, 64) for _ in range(rng.randrange(3, 20))]
            base = plain.generate(prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
                                  use_tqdm=False)[0]
            if len(base.text) < 12:
                continue
            tried += 1
            p = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[base.text[8:10]], logprobs=1)
            want, got = (x.generate(prompt, p, use_tqdm=False)[0].outputs[0] for x in (plain, llm))
            assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
            assert len(got.logprobs) == len(want.logprobs) == len(want.token_ids)
    assert tried >= 20


def test_sampling_defaults_come_from_the_models_generation_config(textpair, tmp_path):
    """generation_config "auto" (vLLM's default): the model's generation_config.json gives the
    sampling a request leaves out, in Python (`get_default_sampling_params`, what generate takes
    without params) and over HTTP (each field the request omits); "vllm": OpenAI's defaults; a value the
    sampler cannot take is refused at start, naming the file."""
    import json

    from drafttree.server.protocol import ChatCompletionRequest
    from tests.tiny import copy_checkpoint

    model = copy_checkpoint(textpair[0], tmp_path / "target")
    (model / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_k": 20, "repetition_penalty": 1.1, "do_sample": True}))
    with LLM(model=str(model), spec="none", **ENGINE) as llm:
        want = {"temperature": 0.6, "top_k": 20, "repetition_penalty": 1.1}
        assert llm.engine.sampling_defaults == want
        d = llm.get_default_sampling_params()
        assert (d.temperature, d.top_p, d.top_k, d.repetition_penalty) == (0.6, 1.0, 20, 1.1)
        req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], temperature=0.2,
                                    repetition_penalty=1.0)
        p = req.sampling_params(8, None, llm.engine.sampling_defaults)
        assert (p.temperature, p.top_k, p.repetition_penalty) == (0.2, 20, 1.0)   # what the request sent wins
    with LLM(model=str(model), spec="none", generation_config="vllm", **ENGINE) as llm:
        assert llm.engine.sampling_defaults == {} and llm.get_default_sampling_params().temperature == 1.0
    (model / "generation_config.json").write_text(json.dumps({"temperature": 3.0}))
    with pytest.raises(ValueError, match="generation_config.json: .*temperature"):
        LLM(model=str(model), spec="none", **ENGINE)
    with pytest.raises(ValueError, match="generation_config must be one of auto, vllm"):
        LLM(model=str(model), spec="none", generation_config="mine", **ENGINE)


def test_generate_from_several_threads_runs_one_call_after_another(llm):
    """Calls from threads share the engine one at a time: each gets its own requests' outputs,
    the tokens it gets alone."""
    import threading

    prompts = ["ab", "hello", "xyz", "q q q"]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    alone = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            got[i] = llm.generate(prompts[i], params, use_tqdm=False)[0].token_ids
        except BaseException as e:   # surfaced below, in the test's thread
            errors.append(e)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and [got[i] for i in range(len(prompts))] == alone


def test_use_tqdm_takes_a_bar_class(llm):
    made = []

    class Bar:
        def __init__(self, total, disable, desc):
            self.total, self.disable, self.done = total, disable, 0
            made.append(self)

        def update(self, n):
            self.done += n

        def close(self):
            self.closed = True

    llm.generate(["a", "b", "c"], SamplingParams(max_tokens=3), use_tqdm=Bar)
    [bar] = made
    assert (bar.total, bar.disable, bar.done, bar.closed) == (3, False, 3, True)


def test_an_llm_as_a_context_manager_and_its_shutdown(textpair):
    with LLM(model=str(textpair[0]), spec="none", enforce_eager=True, **ENGINE) as llm:
        assert llm.engine.setup.cuda_graphs is False   # vLLM's enforce_eager: no CUDA graphs
        assert llm.generate("ab", SamplingParams(max_tokens=2), use_tqdm=False)[0].token_ids
    with pytest.raises(RuntimeError, match="this LLM was shut down"):
        llm.generate("ab")
    llm.shutdown()   # again: nothing to do
    with pytest.raises(TypeError, match=r"unknown arguments \['tokenizer_mode'\].*docs/vllm.md"):
        LLM(model=str(textpair[0]), tokenizer_mode="slow")


def test_repo_ids_resolve_through_the_hugging_face_cache(textpair, tmp_path, monkeypatch):
    """LLM("org/name") and a drafter's repo id load from the local Hugging Face cache, offline;
    a repo the cache lacks is refused, saying where it looked and why it did not download."""
    from huggingface_hub import constants
    cache = fake_hub_cache(tmp_path / "hub", {"acme/tiny-3": textpair[0], "acme/tiny-3-dflash": textpair[1]})
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM(model="acme/tiny-3", draft_model="acme/tiny-3-dflash", spec="ddtree", budget=4, **ENGINE) as hub:
        assert hub.engine.model_dir == cache / "models--acme--tiny-3" / "snapshots" / \
            (cache / "models--acme--tiny-3" / "refs" / "main").read_text()
        got = hub.generate("abc", params, use_tqdm=False)[0].token_ids
    with LLM(model=str(textpair[0]), spec="none", **ENGINE) as local:
        assert got == local.generate("abc", params, use_tqdm=False)[0].token_ids
    with pytest.raises(FileNotFoundError, match=r"model 'acme/absent' is not in the Hugging Face cache \(.*hub\) "
                                                "and HF_HUB_OFFLINE is set"):
        LLM(model="acme/absent", **ENGINE)
    with pytest.raises(FileNotFoundError, match="draft model 'acme/absent'"):
        LLM(model="acme/tiny-3", draft_model="acme/absent", spec="dflash", **ENGINE)


def test_settings_that_cannot_take_effect_are_refused_or_said(textpair, monkeypatch, caplog):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)   # the CPU runs no Triton kernel then
    with pytest.raises(ValueError, match="deterministic=True: deterministic mode's kernels are Triton programs"):
        LLM(model=str(textpair[0]), deterministic=True, **ENGINE)
    with caplog.at_level(logging.WARNING):
        LLM(model=str(textpair[0]), spec="none", budget=8, draft_model=str(textpair[1]), sampler_modes=("greedy",),
            **ENGINE).shutdown()
    assert "spec is 'none' (no speculation): draft_model, budget take no effect" in caplog.text
    assert "sampler_modes greedy take no effect: they choose the round graphs captured and the modes the cost " \
        "model times, and this engine captures no graph and has no cost model" in caplog.text



def test_stop_strings_and_stop_tokens_leave_the_text_unless_asked_to_stay(llm):
    """As vLLM's: the stop string, and the stop token that ended the output, are not in its text;
    include_stop_str_in_output keeps them. The token ids hold the stop token either way."""
    def run(**kw):
        sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, **kw)
        return llm.generate("abc", sp, use_tqdm=False)[0].outputs[0]
    free = run()
    tok = llm.engine.tokenizer
    k = next(i for i in range(3, len(free.token_ids)) if tok.decode(free.token_ids[i:i + 1]).strip())
    t = free.token_ids[k]
    first = free.token_ids.index(t)
    for include in (False, True):
        out = run(stop_token_ids=[t], include_stop_str_in_output=include)
        assert out.token_ids == free.token_ids[:first + 1] and out.finish_reason == "stop" and out.stop_reason == t
        assert out.text == tok.decode(out.token_ids if include else out.token_ids[:-1])
        stop = tok.decode([t])
        out = run(stop=[stop], include_stop_str_in_output=include)
        cut = free.text.index(stop)
        assert out.text == free.text[:cut + len(stop) if include else cut] and out.stop_reason == stop


def test_a_prompt_truncated_to_its_last_tokens_decodes_as_that_prompt(llm):
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    [short] = llm.generate("ghij", sp, use_tqdm=False)
    [cut] = llm.generate("abcdefghij", replace(sp, truncate_prompt_tokens=4), use_tqdm=False)
    assert cut.prompt_token_ids == short.prompt_token_ids and cut.outputs[0].token_ids == short.outputs[0].token_ids
    # -1: as much of the prompt as the context holds with room for one token
    [long] = llm.generate("x" * 200, SamplingParams(temperature=0.0, max_tokens=1, truncate_prompt_tokens=-1),
                          use_tqdm=False)
    assert len(long.prompt_token_ids) == llm.engine.max_model_len - 1


def test_special_tokens_stay_in_the_text_when_asked(tmp_path):
    target = write_tokenizer(make_target(tmp_path / "t", "llama", vocab=97, scale=3.0), 97, eos_token="~")
    with LLM(model=str(target), spec="none", **ENGINE) as llm:
        eos = llm.engine.tokenizer.convert_tokens_to_ids("~")
        def text(**kw):   # the end of sequence made the first token
            sp = SamplingParams(temperature=0.0, max_tokens=4, logit_bias={eos: 100.0}, **kw)
            out = llm.generate("abc", sp, use_tqdm=False)[0].outputs[0]
            assert out.token_ids == [eos] and out.finish_reason == "stop"
            return out.text
        assert text() == text(skip_special_tokens=False) == text(include_stop_str_in_output=True) == ""
        assert text(skip_special_tokens=False, include_stop_str_in_output=True) == "~"
