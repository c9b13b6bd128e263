"""The server's engine thread does model work only: a prompt's text is tokenized on the worker's
tokenizer threads and reaches the engine as ids, to the same output as the engine's own
tokenization."""
from __future__ import annotations

import asyncio
import threading

from drafttree import LLM, SamplingParams
from drafttree.engine.text import Tokenized
from drafttree.server.worker import EngineWorker
from tests.tiny import make_target, write_tokenizer

VOCAB = 128


def test_prompts_are_tokenized_off_the_engine_thread(tmp_path):
    target = write_tokenizer(make_target(tmp_path / "t", "qwen3", vocab=VOCAB), VOCAB)
    llm = LLM(model=str(target), spec="none", device="cpu", dtype="float32", max_num_seqs=2, max_model_len=96)
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = "tokenize me elsewhere"
    (want,) = llm.generate([prompt], params)
    threads, prompts = [], []
    tokenize, read = eng.text.tokenize, eng.read_prompt
    eng.text.tokenize = lambda text: (threads.append(threading.current_thread().name), tokenize(text))[1]
    eng.read_prompt = lambda p, *a, **kw: (prompts.append(p), read(p, *a, **kw))[1]
    worker = EngineWorker(eng)
    worker.start()

    async def run() -> list[int]:
        handle = await worker.submit("r1", prompt, params, with_ids=True)
        snap = await handle.next()
        while not snap.finished:
            snap = await handle.next()
        return list(snap.choices[0].token_ids)
    try:
        got = asyncio.run(run())
    finally:
        worker.stop()
    assert threads and all(t.startswith("drafttree-tokenize") for t in threads), threads
    assert isinstance(prompts[0], Tokenized) and prompts[0].text == prompt
    assert got == want.token_ids


def test_a_prompt_the_tokenizer_refuses_is_a_bad_request(tmp_path):
    import pytest

    from drafttree.server.worker import BadRequest

    target = write_tokenizer(make_target(tmp_path / "t", "qwen3", vocab=VOCAB), VOCAB)
    llm = LLM(model=str(target), spec="none", device="cpu", dtype="float32", max_num_seqs=2, max_model_len=96)
    eng = llm.engine

    def refuse(text):
        raise ValueError("the tokenizer cannot read this")
    eng.text.tokenize = refuse
    worker = EngineWorker(eng)
    worker.start()
    try:
        with pytest.raises(BadRequest, match="cannot read"):
            asyncio.run(worker.submit("r1", "hello", SamplingParams(max_tokens=2)))
    finally:
        worker.stop()
