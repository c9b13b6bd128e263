"""The collectives of a sharded forward, and the hosts' agreements.

A forward at tensor-parallel size N runs, per decoder layer, one all-reduce after the attention's
o projection and one after the MLP's down projection (row-parallel: each rank holds a slice of
their inputs, so each output is a partial sum); one all-reduce after the vocabulary-parallel
embedding and one all-gather of the vocabulary-parallel LM head's logits. None of them syncs the
host (NCCL runs on the device's stream; on the CPU, gloo returns when done), so they are captured
inside the phases' CUDA graphs like any kernel. Nothing here runs at size 1: the layers hold no
group then.

On a simulated rank (`TPGroup.simulated_rank`: one rank of N alone on a device) each collective
is a local operation on the bytes the real one hands this rank, so that the rank's own compute
and memory traffic are what is timed (the link's share is estimated from the recorded message
sizes instead): an all-reduce multiplies the tensor by 1 in place (one read and one write of it,
its values left this rank's partial sum); an all-gather writes the gathered tensor, N times this
rank's part, from that part (one broadcast copy into the output the real one fills); the hosts'
agreements are the identity (this rank's value is every rank's).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.distributed as dist

from drafttree.parallel.group import TPGroup
from drafttree.settings import current

# (op, shape, dtype) of every collective while `recording()` is on (the phase benchmark replays them)
_recorded: list[tuple[str, tuple[int, ...], torch.dtype]] | None = None
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@contextlib.contextmanager
def recording() -> Iterator[list[tuple[str, tuple[int, ...], torch.dtype]]]:
    global _recorded
    _recorded, out = [], []
    try:
        yield out
    finally:
        out += _recorded
        _recorded = None


def all_reduce(x: torch.Tensor, tp: TPGroup | None) -> torch.Tensor:
    """x summed over the ranks, in place (every rank gets the same bits: NCCL's and gloo's
    all-reduce hand every rank the one reduced value); x itself without a group (one device).

    In deterministic mode over more than two ranks the addends are gathered and added in rank
    order: an all-reduce's order of addition per element follows its message size (ring chunks,
    tree or NVLS), so the same token could sum differently in a decode and in a verify. Two
    addends sum alike in either order."""
    if tp is None:
        return x
    if tp.simulated:
        if tp.world > 2 and current().deterministic:
            raise ValueError("a simulated rank does not run deterministic mode's ordered all-reduce (its "
                             "addends are other ranks' values); time deterministic mode over real ranks")
        _record("all_reduce", x.shape, x.dtype)
        return local_all_reduce(x)
    if tp.world > 2 and current().deterministic:
        parts = gather_first(x, tp)
        x.copy_(parts[0])
        for r in range(1, tp.world):
            x += parts[r]
        return x
    _record("all_reduce", x.shape, x.dtype)
    dist.all_reduce(x, group=tp.group)
    return x


def gather_first(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """x of every rank, stacked in rank order: [N, *x.shape]."""
    flat = x.contiguous().view(1, -1)
    _record("all_gather", flat.shape, x.dtype)
    out = torch.empty(tp.world, flat.shape[1], dtype=x.dtype, device=x.device)
    _gather(out, flat, tp)
    return out.view(tp.world, *x.shape)


def gather_last(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """x [..., n] of every rank, concatenated in rank order along the last dimension: [..., N * n]."""
    n = x.shape[-1]
    flat = x.reshape(-1, n).contiguous()
    _record("all_gather", flat.shape, x.dtype)
    out = torch.empty(tp.world * flat.shape[0], n, dtype=x.dtype, device=x.device)
    _gather(out, flat, tp)
    return out.view(tp.world, flat.shape[0], n).transpose(0, 1).reshape(*x.shape[:-1], tp.world * n)


def _record(op: str, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> None:
    if _recorded is not None:
        _recorded.append((op, tuple(shape), dtype))


def _gather(out: torch.Tensor, part: torch.Tensor, tp: TPGroup) -> None:
    """out [N * rows, ...] = every rank's part [rows, ...], in rank order."""
    if tp.simulated:
        local_all_gather(out, part)
    else:
        _gather_into(out, part, group=tp.group)


def local_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """A simulated rank's all-reduce: x * 1 in place, one read and one write of x."""
    return x.mul_(1)


def local_all_gather(out: torch.Tensor, part: torch.Tensor) -> None:
    """A simulated rank's all-gather: out [N * rows, ...] written whole from this rank's part
    [rows, ...] (each rank's slot a copy of it, one broadcast copy)."""
    out.view(-1, *part.shape).copy_(part.expand(out.shape[0] // part.shape[0], *part.shape))


def replay(ops: list[tuple[str, tuple[int, ...], torch.dtype]], tp: TPGroup, device: torch.device):
    """A function that runs the recorded collectives again on buffers of their shapes (made once);
    on a simulated rank their local operations."""
    bufs = [torch.zeros(shape, dtype=dtype, device=device) for _, shape, dtype in ops]
    outs = [torch.empty(tp.world * s[0], *s[1:], dtype=d, device=device) if op == "all_gather" else None
            for (op, s, d) in ops]

    def run() -> None:
        for (op, _, _), b, o in zip(ops, bufs, outs):
            if op != "all_reduce":
                _gather(o, b, tp)
            elif tp.simulated:
                local_all_reduce(b)
            else:
                dist.all_reduce(b, group=tp.group)
    return run


# -- the hosts' agreements (the gloo group) ---------------------------------------------------------


def from_leader(value: Any, tp: TPGroup | None) -> Any:
    """Rank 0's value on every rank (a choice the clock or memory makes, which ranks must share)."""
    if tp is None or tp.simulated:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=tp.cpu)
    return box[0]


def smallest(value: int, tp: TPGroup | None) -> int:
    """The least of the ranks' values (what every rank's memory holds)."""
    if tp is None or tp.simulated:
        return value
    t = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.cpu)
    return int(t)


def gather_objects(value: Any, tp: TPGroup) -> list[Any]:
    """Every rank's value, in rank order (a simulated rank's stands for all)."""
    if tp.simulated:
        return [value] * tp.world
    out: list[Any] = [None] * tp.world
    dist.all_gather_object(out, value, group=tp.cpu)
    return out


def explain(error: BaseException, tp: TPGroup, known: str | None = None) -> str:
    """What a failed step says: the dead rank the watcher saw, a timeout, or the error itself."""
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    if known:
        return f"{known}; the engine stopped ({type(error).__name__}: {text})"
    if "timed out" in text.lower() or "timeout" in text.lower():
        return (f"a tensor-parallel collective timed out after {tp.timeout_s:g} s (a rank stopped responding); "
                f"the engine stopped ({text})")
    if "connection closed" in text.lower() or "connection reset" in text.lower():
        return f"a tensor-parallel rank exited; the engine stopped ({text})"
    return f"a tensor-parallel step failed; the engine stopped ({type(error).__name__}: {text})"
