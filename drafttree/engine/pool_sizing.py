"""How many KV pages an engine's pool gets, and the context a request may reach with them.

The pool takes the KV budget (`kv_cache_memory_gb`, or what `gpu_memory_utilization` leaves of
the device once the weights are loaded and the CUDA graphs' activations are set aside), at most
what every row at max_model_len would fill. A token's K/V lives in every pool that holds it: the
target's (MLA: its latent only; tensor-parallel: this rank's KV heads, the pool holding the same
pages on every rank) and the drafter's.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from drafttree.engine.memory_plan import after_pool_bytes, setup_graphs
from drafttree.engine.plan import EngineSetup
from drafttree.models.kv_cache import KVLayout
from drafttree.parallel.comm import smallest
from drafttree.parallel.group import TPGroup

log = logging.getLogger(__name__)

FIX = "raise --kv-cache-memory-gb or --gpu-memory-utilization (in Python: kv_cache_memory_gb, ...)"


@dataclass(frozen=True)
class PoolSize:
    max_model_len: int     # the longest context a request may reach
    num_pages: int         # pages in the pool, the null page included
    bytes_per_token: int   # K/V of one token in every pool, on this rank
    budget: int            # bytes the pool may take
    source: str            # where the budget comes from


def size_pool(setup: EngineSetup, tp: TPGroup | None = None) -> PoolSize:
    """The pool for the setup on this rank (after its weights are loaded: `gpu_memory_utilization`
    counts what they took). Refuses a budget that holds no useful context."""
    cfg, ps = setup.cfg, setup.cfg.page_size
    bpt = KVLayout.of(setup.target, setup.world, 0 if tp is None else tp.rank).bytes_per_token(setup.dtype)
    if setup.drafter is not None:
        bpt += KVLayout.of(setup.drafter.model).bytes_per_token(setup.dtype)
    budget, source = kv_budget(setup)
    headroom = setup.spec.kv_headroom
    pages = smallest(budget // (bpt * ps), tp)   # rank 0's page ids name a page on every rank
    fit = (pages - 1) * ps - headroom     # the longest context one request can hold
    wanted = cfg.max_model_len or setup.target.max_position_embeddings
    max_len = min(wanted, fit)
    if max_len < 16:
        raise ValueError(f"KV cache budget of {budget / 2**30:.3g} GiB ({source}) holds {max(pages, 0)} pages "
                         f"of {ps} tokens at {bpt} bytes per token: a context of {max(fit, 0)} tokens; {FIX}")
    if fit < wanted:
        whose = "the requested" if cfg.max_model_len else "the model's"
        log.warning("max_model_len %d < %s %d: the KV cache budget of %.3g GiB (%s) holds %d pages of %d "
                    "tokens at %d bytes per token (%d of a request's slots are headroom for a round's "
                    "writes); %s, or pass --max-model-len %d to ask for less",
                    max_len, whose, wanted, budget / 2**30, source, pages, ps, bpt, headroom, FIX, max_len)
    per_row = -(-(max_len + headroom) // ps)
    return PoolSize(max_len, min(pages, 1 + cfg.max_num_seqs * per_row), bpt, budget, source)


def kv_budget(setup: EngineSetup) -> tuple[int, str]:
    """(bytes the KV pool may take, where that figure comes from)."""
    cfg = setup.cfg
    if cfg.kv_cache_memory_gb is not None:
        if cfg.gpu_memory_utilization is not None:
            raise ValueError("give kv_cache_memory_gb or gpu_memory_utilization, not both")
        return int(cfg.kv_cache_memory_gb * (1 << 30)), "kv_cache_memory_gb"
    if setup.device.type != "cuda":
        if cfg.gpu_memory_utilization is not None:
            raise ValueError("gpu_memory_utilization sizes a CUDA device's KV pool; on "
                             f"{setup.device.type} give kv_cache_memory_gb")
        return 1 << 30, "the default on CPU"
    free, total = torch.cuda.mem_get_info(setup.device)
    if cfg.gpu_memory_utilization is None:
        return int(free * 0.6), "the default: 60% of the free CUDA memory"
    util = cfg.gpu_memory_utilization
    if not 0 < util <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util}")
    # what the weights (and anything else) took is gone from `free`; the graphs' activations and
    # the rounds' buffers are allocated after the pool, so they are set aside as the plan does
    graphs, buffers = after_pool_bytes(setup.target, setup.drafter, setup.spec, cfg.max_num_seqs,
                                       cfg.max_model_len or setup.target.max_position_embeddings, cfg.page_size,
                                       setup.dtype, setup.world, **setup_graphs(setup))
    budget = int(util * total) - (total - free) - graphs - buffers
    return max(budget, 0), f"gpu_memory_utilization {util}: of {total / 2**30:.1f} GiB, less what is in use" + \
        (", the CUDA graphs' estimate" if graphs else "") + " and the rounds' buffers"
