"""What the tensor-parallel tests share: mixed sampling rows, a tiny pair's engine over several
gloo ranks, and a rank's view of a group for building shard shapes without processes."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from drafttree import LLM, SamplingParams
from drafttree.parallel.group import TPGroup
from tests.helpers import Pair, every_round

MAX_TOKENS = [32, 11, 23]   # rows finish at different rounds: the others move down (a command too)


def mixed() -> list[SamplingParams]:
    """A greedy row, a sampled row and a filtered sampled row, each seeded."""
    return [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[0], ignore_eos=True),
            SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_TOKENS[1], ignore_eos=True),
            SamplingParams(temperature=0.8, top_p=0.9, top_k=4, seed=11, max_tokens=MAX_TOKENS[2], ignore_eos=True)]


@contextlib.contextmanager
def sharded(pair: Pair, spec: str, world: int = 2) -> Iterator[LLM]:
    """The engine `pair.llm(spec)` is, over `world` ranks."""
    llm = LLM(model=str(pair.target), draft_model=None if spec == "none" else str(pair.drafter), spec=spec,
              budget=every_round(spec, None), device="cpu", dtype="float32", max_num_seqs=3, max_model_len=128,
              tensor_parallel_size=world)
    try:
        yield llm
    finally:
        llm.shutdown()


def fake_group(rank: int, world: int) -> TPGroup:
    """A group of `world` ranks for building shard shapes on the meta device (no collective runs)."""
    return TPGroup(rank, world, torch.device("cpu"), None, None, 60.0)
