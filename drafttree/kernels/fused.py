"""Small pieces compiled into one or a few kernels on CUDA (eager on CPU).

At batch 1 a decoder step is launch- and kernel-count-bound: an RMSNorm written in torch ops is
six kernels, a round's acceptance walk about 25. `torch.compile` fuses each `fused` function (the
norms, rope, and a round's bookkeeping: rope tables, masks, draft inputs, the walk) into one or a
few Triton kernels; it is applied only to CUDA tensors, so CPU runs (tests, CI) stay plain PyTorch.
A piece whose compilation fails on a platform runs as torch ops from then on, with one warning.
`settings.compile` (DRAFTTREE_COMPILE) "0" turns it off; "cpu" compiles on CPU too (for tests of
the wrapper itself).

Each call reads `settings.compile` in force (`drafttree.settings.current()`, the calling engine's),
so engines with different choices in one process each get theirs. What is kept across calls is
not a settings choice: a piece's compiled form (the pieces are torch ops alone and read no
settings, so one compiled form serves every engine that compiles), a failed compilation (a fact
of the platform), and Inductor's cache directory, which Inductor reads from the process's
environment: it is set once, from the settings in force at the first compilation (the engine sets
it, and Triton's, before it loads: `kernels.compile_cache`).
"""
from __future__ import annotations

import functools
import logging
from typing import Callable, TypeVar

import torch

from drafttree.kernels import compile_cache
from drafttree.settings import current

F = TypeVar("F", bound=Callable)
log = logging.getLogger(__name__)


def fused(fn: F, *, eager: Callable | None = None) -> F:
    """`eager`: what runs where the piece is not compiled, in place of `fn` itself (the same
    result, computed with less memory where `fn`'s torch ops would hold large temporaries)."""
    compiled: list[Callable | None] = []
    ops = eager or fn

    @functools.wraps(fn)
    def wrapper(x: torch.Tensor, *args, **kwargs):
        mode = current().compile
        if mode == "0" or not (x.is_cuda or mode == "cpu") or compiled == [None]:
            return ops(x, *args, **kwargs)
        if not compiled:
            compiled.append(_compile(fn))
        try:
            return compiled[0](x, *args, **kwargs)   # type: ignore[misc]
        except Exception as e:
            # A compiler that fails on this platform costs the piece its fusion, not the request:
            # where the torch ops succeed, they run from now on. (Errors of the inputs raise again.)
            out = ops(x, *args, **kwargs)
            log.warning("compiling %s failed (%s: %s); it runs as torch ops", fn.__name__, type(e).__name__,
                        str(e).splitlines()[0] if str(e) else "")
            compiled[0] = None
            return out
    return wrapper  # type: ignore[return-value]


RECOMPILE_LIMIT = 64


def persist_compile_cache() -> str:
    """Where Inductor keeps what it compiles: TORCHINDUCTOR_CACHE_DIR if set, else this platform's
    directory under drafttree's cache (`compile_cache.install`, which places Triton's beside it).
    Inductor's own default is under /tmp, which a reboot empties, and a server compiles its
    pieces for every graph shape it captures at start-up; kept with the converted models, a
    restarted machine finds them."""
    return compile_cache.install()["inductor"]


def _compile(fn: Callable) -> Callable:
    """Each new dtype or float constant (an eps, a rope factor) is one more compiled variant;
    a process holding several models (tests, benchmarks) passes Dynamo's default of 8. The
    limit is raised, and without fullgraph a piece past it runs eagerly instead of raising."""
    persist_compile_cache()
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, name, max(getattr(cfg, name), RECOMPILE_LIMIT))
    return torch.compile(fn, dynamic=True)
