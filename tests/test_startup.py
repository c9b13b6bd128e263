"""Start-up, weight-free: the prefill graphs captured are exactly the shapes the engine's
admission can ask for, and the warm-up plan covers the paths graphs do not."""
from __future__ import annotations

import random
from collections import deque
from types import SimpleNamespace

import pytest

from drafttree.engine.engine import Engine
from drafttree.engine.warmup import warmup_batches
from drafttree.runner.prefill_graph import MIN_LEN, group_shapes, prefill_shapes
from drafttree.sampling import SampleMode


def admitted_groups(max_num_seqs: int, max_prefill_tokens: int, queue: list[int]) -> list[tuple[int, int]]:
    """(prompts, longest) of every prefill the engine's own `_prefill_group` forms from `queue`
    (prompt lengths, oldest first), for every number of free rows."""
    out = []
    for free in range(1, max_num_seqs + 1):
        stub = SimpleNamespace(waiting=deque(SimpleNamespace(prompt_ids=[0] * n) for n in queue),
                               cfg=SimpleNamespace(max_prefill_tokens=max_prefill_tokens))
        group = Engine._prefill_group(stub, free)
        out.append((len(group), max(len(s.prompt_ids) for s in group)))
    return out


CASES = [   # max_num_seqs, max_prefill_tokens, max_model_len, max_tokens (graphed tokens), cache length
    (4, 8192, 300, 2048, 333),
    (8, 100, 200, 64, 233),
    (3, 40, 40, 2048, 41),
    (6, 8192, 20, 16, 53),
    (5, 70, 129, 128, 129),
]


@pytest.mark.parametrize("rows,max_prefill,max_model_len,max_tokens,max_len", CASES)
def test_prefill_shapes_are_exactly_what_the_engine_asks(rows, max_prefill, max_model_len, max_tokens, max_len):
    """Every queue of prompts the engine may hold (each length alone, and random mixes) goes
    through its real admission and the runner's grouping; the shapes replayed are the set
    captured at start-up, no more and no fewer."""
    asked: set[tuple[int, int]] = set()
    queues = [[P] * (rows + 1) for P in range(1, max_model_len)]
    rng = random.Random(0)
    queues += [[rng.randint(1, max_model_len - 1) for _ in range(rows + 1)] for _ in range(200)]
    for q in queues:
        for n, longest in admitted_groups(rows, max_prefill, q):
            asked.update(group_shapes(n, longest, max_tokens, max_len) or ())
    captured = prefill_shapes(rows, max_prefill, max_model_len - 1, max_tokens, max_len)
    assert len(captured) == len(set(captured))
    assert set(captured) == asked
    assert all(Pb >= MIN_LEN and Pb <= min(max_tokens, max_len) and n * Pb <= max(max_tokens, Pb) for n, Pb in captured)


def test_prefill_groups_split_by_graphed_tokens():
    assert group_shapes(5, 300, 1024, 4096) == [(2, 512), (2, 512), (1, 512)]
    assert group_shapes(1, 3, 2048, 4096) == [(1, 16)]
    assert group_shapes(1, 3000, 2048, 4096) is None   # longer than graphed: eager


def test_warmup_plan_covers_modes_rows_and_eager_prefill():
    plan = warmup_batches(True, max_num_seqs=8, max_prompt_len=4000, max_prefill_tokens=8192, graphed_len=2048)
    seen = {(SampleMode.of([b.params]), len(b.prompt_lens)) for b in plan}
    assert seen >= {(m, n) for m in SampleMode for n in (1, 2)}
    eager = sorted(n for b in plan for n in b.prompt_lens if n > 2048)
    assert {n % 16 == 0 for n in eager} == {True, False}   # Triton specializes on multiples of 16
    assert {(n - 2048) % 16 for n in eager} >= {0, 1, 2}    # and the chunk past 2048 on 1 and on 16k
    assert any(len(b.prompt_lens) == 2 and min(b.prompt_lens) > 2048 for b in plan)
    assert all(b.params.max_tokens >= 2 for b in plan)


def test_warmup_plan_stays_within_the_context_and_rows():
    plan = warmup_batches(True, max_num_seqs=1, max_prompt_len=10, max_prefill_tokens=8192, graphed_len=16)
    assert all(len(b.prompt_lens) == 1 and max(b.prompt_lens) <= 10 for b in plan)
    assert {SampleMode.of([b.params]) for b in plan} == set(SampleMode)
    cpu = warmup_batches(False, max_num_seqs=8, max_prompt_len=4000, max_prefill_tokens=8192, graphed_len=0)
    assert len(cpu) == 1 and len(cpu[0].prompt_lens) == 1   # a short dummy generate
