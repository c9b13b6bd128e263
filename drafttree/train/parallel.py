"""Data-parallel drafter training over the processes that `torchrun` starts (one per GPU).

Every rank holds the whole drafter and target, takes every world-th batch of an epoch, and
averages gradients before the optimizer step. The drafter is small (~10 M parameters in a few
dozen tensors), so the all-reduces cost little next to the step itself. The ranks start equal (same seed,
then a broadcast from rank 0), and they stay equal because each one applies the same update.
Decisions that the clock makes (stop, fit the schedule) are made by rank 0 and shared, so that
every rank runs the same number of steps.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from drafttree.config import resolve_device

T = TypeVar("T")


@dataclass(frozen=True)
class Group:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    def device(self, requested: str | None) -> torch.device:
        dev = resolve_device(requested)
        if dev.type == "cuda" and self.world > 1:
            return torch.device("cuda", self.local_rank)
        return dev

    def shard(self, batches: list[T]) -> list[T]:
        """This rank's batches: every world-th, the same count on every rank."""
        if self.world == 1:
            return batches
        per_rank = len(batches) // self.world
        return batches[self.rank::self.world][:per_rank]

    def steps_per_epoch(self, num_batches: int) -> int:
        steps = num_batches // self.world
        if steps < 1:
            raise ValueError(f"{num_batches} batches per epoch cannot feed {self.world} ranks")
        return steps

    def average_grads(self, params: Iterable[torch.nn.Parameter]) -> None:
        if self.world == 1:
            return
        for p in params:
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= self.world

    def broadcast_module(self, module: torch.nn.Module) -> None:
        if self.world > 1:
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t.data, src=0)

    def decide(self, value: int, device: torch.device) -> int:
        """Rank 0's value, on every rank."""
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.long, device=device)
        dist.broadcast(t, src=0)
        return int(t)

    def gather(self, obj: Any) -> list[Any]:
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out


def init_group() -> Group:
    """The process group `torchrun` describes in the environment; a single process otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Group()
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(local)
        dist.init_process_group(backend)
    return Group(rank, world, local)


def close_group(group: Group) -> None:
    if group.world > 1 and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
