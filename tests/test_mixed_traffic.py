"""Requests of every kind arriving while others decode (tiny random models, CPU, fp32): free,
seeded, penalised, with log-probabilities, a stop token, a regex or a JSON schema, some aborted
mid-way, in a KV pool small enough to preempt, with overlapped rounds and without. Every request
that was not aborted equals what plain decoding gives it alone, token for token (up to where a
shortened context ends it). On a GPU (bf16, CUDA graphs, overlapped rounds) in deterministic mode,
where plain decoding's tokens are speculative decoding's bit for bit."""
from __future__ import annotations

import random

import pytest

pytest.importorskip("llguidance", reason="structured outputs run on llguidance (a dependency)")

from drafttree import LLM, SamplingParams  # noqa: E402
from drafttree.engine.engine import Engine, EngineConfig  # noqa: E402
from drafttree.structured.params import StructuredOutputs  # noqa: E402
from tests.helpers import gpu  # noqa: E402
from tests.tiny import make_drafter, make_target, write_tokenizer  # noqa: E402

VOCAB = 128
MAX_LEN = 160
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "b": {"enum": ["xy", "zzz"]}},
          "required": ["a", "b"], "additionalProperties": False}
WORDS = ["hello", "world", "abc", "q", "xyz", "foo"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixed")
    target = write_tokenizer(make_target(root / "target", "qwen3", vocab=VOCAB, scale=3.0), VOCAB, eos_token="<extra_0>")
    return target, make_drafter(root / "drafter", target, block_size=4)


@pytest.fixture(scope="module")
def plains(pair):
    """Plain decoding per device: the CPU's fp32, the GPU's bf16 in deterministic mode."""
    made: dict[str, LLM] = {}

    def plain(device: str) -> LLM:
        if device not in made:
            made[device] = LLM(model=str(pair[0]), spec="none", max_num_seqs=4, max_model_len=MAX_LEN,
                               **DEVICES[device])
        return made[device]
    return plain


DEVICES = {"cpu": dict(device="cpu", dtype="float32"), "cuda": dict(device="cuda", dtype="bfloat16", deterministic=True)}


def request(rng: random.Random) -> tuple[str, SamplingParams]:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 12)))
    n = rng.choice([5, 20, 40, None])
    kind = rng.choice(["free", "seeded", "penalised", "logprobs", "stop", "regex", "json"])
    params = {
        "free": lambda: SamplingParams(temperature=0, max_tokens=n, ignore_eos=rng.random() < 0.5),
        "seeded": lambda: SamplingParams(temperature=rng.choice([0.7, 1.0]), top_p=rng.choice([1.0, 0.9]),
                                         top_k=rng.choice([0, 20]), seed=rng.randrange(100), max_tokens=n),
        "penalised": lambda: SamplingParams(temperature=0, max_tokens=n, presence_penalty=0.5, frequency_penalty=0.3),
        "logprobs": lambda: SamplingParams(temperature=0, max_tokens=n, logprobs=2),
        "stop": lambda: SamplingParams(temperature=0, max_tokens=n, stop_token_ids=[rng.randrange(VOCAB)]),
        "regex": lambda: SamplingParams(temperature=0, max_tokens=n or 30,
                                        structured_outputs=StructuredOutputs(regex="[a-z]{2,6}-[0-9]{2}")),
        "json": lambda: SamplingParams(temperature=rng.choice([0, 1.0]), seed=5, max_tokens=n or 60,
                                       structured_outputs=StructuredOutputs(json=SCHEMA)),
    }[kind]()
    return prompt, params


@pytest.mark.parametrize("spec,budget", [("ddtree", 8), ("ddtree", "auto"), ("dflash", None)])
@pytest.mark.parametrize("device,seed", [("cpu", 0), ("cpu", 1), gpu("cuda", 2)])
def test_requests_arriving_while_others_decode_equal_plain_decoding(pair, plains, spec, budget, device, seed):
    rng = random.Random(seed)
    target, drafter = pair
    plain = plains(device)
    eng = Engine(EngineConfig(model=str(target), draft_model=str(drafter), spec=spec, budget=budget,
                              max_num_seqs=4, max_model_len=MAX_LEN, overlap=seed != 1, kv_cache_memory_gb=0.0002,
                              **DEVICES[device]))
    arrivals = sorted(rng.randrange(60) for _ in range(10))
    added, aborts, aborted, step = [], [], set(), 0
    while arrivals or eng.has_unfinished():
        while arrivals and arrivals[0] <= step:
            arrivals.pop(0)
            prompt, params = request(rng)
            seq = eng.add_request(prompt, params)
            added.append((prompt, params, seq))
            if rng.random() < 0.15:
                aborts.append((step + rng.randrange(1, 20), seq))
        for when, seq in [a for a in aborts if a[0] <= step]:
            aborts.remove((when, seq))
            eng.abort(seq)
            aborted.add(seq.request_id)
        eng.step()
        step += 1
    for prompt, params, seq in added:
        if seq.request_id in aborted:
            continue
        want = plain.generate([prompt], [params], use_tqdm=False)[0].token_ids
        got = seq.output_ids
        # the small pool shortens the context: a request it ends keeps plain decoding's first tokens
        ended = seq.finish_reason == "length" and len(seq.prompt_ids) + len(got) >= eng.max_model_len
        assert got == (want[:len(got)] if ended else want), (prompt, params)
    eng.shutdown()
