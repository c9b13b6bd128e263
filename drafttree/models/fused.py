"""Small elementwise pieces compiled into single kernels on CUDA (eager on CPU).

At batch 1 a decoder step is launch- and kernel-count-bound: an RMSNorm written in torch ops is
six kernels. `torch.compile` fuses each piece below into one Triton kernel; it is applied only
to CUDA tensors, so CPU runs (tests, CI) stay plain PyTorch. DRAFTTREE_COMPILE=0 turns it off.
"""
from __future__ import annotations

import functools
import os
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)


def fused(fn: F) -> F:
    compiled: list[Callable] = []

    @functools.wraps(fn)
    def wrapper(x: torch.Tensor, *args, **kwargs):
        if not x.is_cuda or os.environ.get("DRAFTTREE_COMPILE", "1") == "0":
            return fn(x, *args, **kwargs)
        if not compiled:
            compiled.append(torch.compile(fn, dynamic=True, fullgraph=True))
        return compiled[0](x, *args, **kwargs)
    return wrapper  # type: ignore[return-value]
