"""Overlapped rounds (the next round launched before this one's tokens are read) emit exactly
what reading each round first emits: on CPU (fp32) the engine runs the same schedule, so the
bookkeeping is checked here — requests that finish inside an unread round, admissions and
aborts while a round is in flight, rows that move, the context's end."""
from __future__ import annotations

import pytest
import torch

from drafttree import LLM, SamplingParams
from drafttree.engine.engine import Engine, EngineConfig
from tests.tiny import make_drafter, make_target

VOCAB = 7   # a random drafter is right often enough that rounds commit several tokens


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("overlap")
    t = make_target(root / "t", "qwen3", vocab=VOCAB, layers=2, scale=3.0)
    return t, make_drafter(root / "d", t, block_size=4, target_layer_ids=[0, 1])


def _engine(pair, spec: str, overlap: bool, **kw) -> Engine:
    t, d = pair
    return Engine(EngineConfig(model=str(t), draft_model=str(d) if spec != "none" else None, spec=spec,
                               device="cpu", dtype="float32", overlap=overlap, **kw))


def _run(eng: Engine, prompts, params) -> list[tuple[list[int], str | None, int]]:
    seqs = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    while eng.has_unfinished():
        eng.step()
    return [(s.output_ids, s.finish_reason, len(s.stats.accept_lengths)) for s in seqs]


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(k),), generator=g).tolist()
            for k in torch.randint(1, 20, (n,), generator=g)]


@pytest.mark.parametrize("spec", ["none", "dflash", "ddtree"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_overlap_emits_what_reading_first_emits(pair, spec, temperature):
    """Six requests through three rows (admissions while a round is in flight), of different
    lengths, two of them stopped by a token id inside a round."""
    prompts = _prompts(6)
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=m, ignore_eos=True,
                             stop_token_ids=[3] if i in (1, 4) else [])
              for i, m in enumerate([5, 40, 17, 2, 33, 26])]
    kw = dict(budget=6) if spec == "ddtree" else dict(budget=1)
    want = _run(_engine(pair, spec, False, max_num_seqs=3, **kw), prompts, params)
    eng = _engine(pair, spec, True, max_num_seqs=3, **kw)
    got = _run(eng, prompts, params)
    assert got == want
    assert {f for _, f, _ in got} >= {"length", "stop"}
    if spec != "none" and temperature == 0.0:
        plain = _run(_engine(pair, "none", False, max_num_seqs=3), prompts, params)
        assert [o for o, _, _ in got] == [o for o, _, _ in plain]
        assert max(eng.stats.accept_hist) > 1   # rounds that commit several tokens


@pytest.mark.parametrize("spec", ["none", "ddtree"])
def test_overlap_stops_at_the_context_end(pair, spec):
    """Requests that run into max_model_len: the engine reads first near the end, so no round
    writes past a cache row (CPU indexing would raise) and the outputs stop where they should."""
    prompts = _prompts(3, seed=1)
    params = [SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)] * 3
    kw = dict(budget=6) if spec == "ddtree" else dict(budget=1)
    want = _run(_engine(pair, spec, False, max_num_seqs=2, max_model_len=48, **kw), prompts, params)
    got = _run(_engine(pair, spec, True, max_num_seqs=2, max_model_len=48, **kw), prompts, params)
    assert got == want
    assert all(f == "length" and len(p) + len(o) == 48 for (o, f, _), p in zip(got, prompts))


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_while_a_round_is_in_flight(pair, overlap):
    """Aborting the first of three running requests moves the last one's row while its next round
    is unread: the other two still emit what they emit alone."""
    prompts = _prompts(3, seed=2)
    sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    alone = [LLM(model=str(pair[0]), draft_model=str(pair[1]), spec="ddtree", budget=6, device="cpu",
                 dtype="float32").generate([p], sp)[0].token_ids for p in prompts]
    eng = _engine(pair, "ddtree", overlap, max_num_seqs=3, budget=6)
    seqs = [eng.add_request(p, sp) for p in prompts]
    for _ in range(3):
        eng.step()
    assert (eng._inflight is not None) == overlap
    eng.abort(seqs[0])
    while eng.has_unfinished():
        eng.step()
    assert seqs[0].finish_reason == "abort" and len(seqs[0].output_ids) < 30
    assert [s.output_ids for s in seqs[1:]] == alone[1:]


def test_overlap_default_follows_the_device(pair):
    assert _engine(pair, "none", None).overlap is False   # CPU: rounds are synchronous anyway
    assert _engine(pair, "none", True).overlap is True


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["none", "dflash", "ddtree"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_overlap_emits_what_reading_first_emits(pair, spec, dtype):
    """On CUDA with graphs: the pinned copies and their events, rounds replayed while the host
    reads the one before."""
    prompts = _prompts(6)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=m, ignore_eos=True,
                             stop_token_ids=[3] if i in (1, 4) else [])
              for i, m in enumerate([5, 40, 17, 2, 33, 26])]
    t, d = pair
    kw = dict(budget=6) if spec == "ddtree" else dict(budget=1)
    outs = [_run(Engine(EngineConfig(model=str(t), draft_model=str(d) if spec != "none" else None, spec=spec,
                                     device="cuda", dtype=dtype, max_num_seqs=3, max_model_len=256,
                                     overlap=overlap, **kw)), prompts, params) for overlap in (False, True)]
    assert outs[1] == outs[0]


def test_decode_rounds_of_a_speculative_engine_overlap_to_the_last_token(pair, monkeypatch):
    """A round at budget 0 commits one token per request, so a speculative engine whose rounds
    decode drains (reads a round before launching the next) only where plain decoding does: at
    each request's last token, not in its last block_size tokens. Outputs stay plain decoding's."""
    prompts = _prompts(3, seed=1)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (12, 20, 31)]
    drains = {}
    outputs = {}
    for spec, kw in (("none", {}), ("ddtree", dict(budget=6, budget_schedule="1:0"))):
        eng = _engine(pair, spec, True, max_num_seqs=3, **kw)
        count = [0]
        real = eng._drain

        def drain(real=real, count=count):
            count[0] += eng._inflight is not None
            return real()
        monkeypatch.setattr(eng, "_drain", drain)
        outputs[spec] = [o for o, _, _ in _run(eng, prompts, params)]
        drains[spec] = count[0]
        assert set(eng.stats.budget_hist) == {0}
    assert outputs["ddtree"] == outputs["none"]
    assert drains["ddtree"] == drains["none"] <= len(prompts) + 1
