"""The process group of one engine's ranks: where each rank comes from (torchrun's environment,
or rank 0's spawn), and its two groups over the same ranks.

`group` carries the model's collectives (NCCL on CUDA, gloo on CPU); `cpu` (gloo) carries what
the hosts say to each other: rank 0's step commands and the few start-up agreements (the KV pool's
size). Step commands on a host group never wait behind device work and never sync a device.

A simulated rank (`TPGroup.simulated_rank`) stands for rank r of N on one device, with no process
group: the model builds and runs exactly rank r's shards, and every collective becomes a local
operation on the same bytes (`parallel.comm`), so that one GPU measures one rank's own compute
and memory.
"""
from __future__ import annotations

import gc
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# Seconds a collective may wait for the other ranks before it fails (`EngineConfig.distributed_timeout_s`).
DEFAULT_TIMEOUT_S = 300.0
# The rendezvous waits longer: a spawned rank imports torch and the engine before it joins.
STARTUP_TIMEOUT_S = 600.0


class TensorParallelError(RuntimeError):
    """A rank died, a collective timed out, or a rank failed: the engine's ranks no longer agree,
    so the engine stops."""


@dataclass(frozen=True)
class Launch:
    """This process's place in the group and how the ranks meet (an init_method URL)."""
    rank: int
    world: int
    local_rank: int
    init_method: str
    local_world: int = 0    # ranks on this host (torchrun's LOCAL_WORLD_SIZE); 0: all of them


@dataclass(frozen=True)
class TPGroup:
    rank: int
    world: int
    device: torch.device    # this rank's device: cuda:local_rank on CUDA
    group: Any              # ProcessGroup: the model's collectives
    cpu: Any                # ProcessGroup (gloo): step commands and host agreements
    timeout_s: float
    generation: int = 0     # which of this process's groups, in order (`close_group` closes only its own)
    simulated: bool = False  # no process group: collectives run as local operations (`simulated_rank`)

    @classmethod
    def simulated_rank(cls, rank: int, world: int, device: torch.device) -> "TPGroup":
        """Rank `rank` of `world` on `device` alone, without a process group: the model builds that
        rank's shards and its collectives run as local operations on the same bytes (`parallel.comm`);
        the values are that rank's partial sums, not the group's (timing and memory only)."""
        if world < 2 or not 0 <= rank < world:
            raise ValueError(f"a simulated rank is one of 2 or more ranks: got rank {rank} of {world}")
        return cls(rank, world, torch.device(device), None, None, DEFAULT_TIMEOUT_S, simulated=True)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"


def torchrun_launch() -> Launch | None:
    """The launch torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT;
    `--nnodes` for several hosts), or None outside torchrun."""
    env = os.environ
    if int(env.get("WORLD_SIZE", "1")) <= 1 or "RANK" not in env:
        return None
    world = int(env["WORLD_SIZE"])
    return Launch(int(env["RANK"]), world, int(env.get("LOCAL_RANK", "0")), "env://",
                  int(env.get("LOCAL_WORLD_SIZE", world)))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device: torch.device, launch: Launch) -> torch.device:
    """A rank's device: its local rank's GPU on CUDA (one GPU per rank), else the device as given."""
    return torch.device("cuda", launch.local_rank) if device.type == "cuda" else device


def init_group(launch: Launch, device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S) -> TPGroup:
    """Join the ranks of `launch` (every rank calls this) and build the two groups."""
    device = rank_device(device, launch)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl":
        # NCCL's collectives are captured in the phases' CUDA graphs: without this, the process
        # group's recordStream calls on graph-pool tensors leak and can break captures (vLLM #2152).
        os.environ.setdefault("TORCH_NCCL_AVOID_RECORD_STREAMS", "1")
    check_free()
    dist.init_process_group(backend, init_method=launch.init_method, rank=launch.rank, world_size=launch.world,
                            timeout=timedelta(seconds=max(timeout_s, STARTUP_TIMEOUT_S)))
    global _generation
    _generation += 1
    try:
        timeout = timedelta(seconds=timeout_s)
        group = dist.new_group(backend=backend, timeout=timeout)
        cpu = dist.new_group(backend="gloo", timeout=timeout)
        # The first collective: NCCL creates its communicator here, never inside a graph capture.
        probe = torch.ones(1, device=device)
        dist.all_reduce(probe, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except BaseException:
        dist.destroy_process_group()
        raise
    return TPGroup(launch.rank, launch.world, device, group, cpu, timeout_s, _generation)


# The process groups this process joined, counted: a group's TPGroup carries its number, so that
# closing an engine that is collected late (its finalizer) never ends a newer engine's group.
_generation = 0


def check_free() -> None:
    """Refuse to start a tensor-parallel engine while another one's group lives in this process
    (torch.distributed has one default group a process). An engine no longer referenced but not yet
    collected is collected first, which closes its group."""
    if dist.is_initialized():
        gc.collect()
    if dist.is_initialized():
        raise RuntimeError("another tensor-parallel engine lives in this process (one at a time: torch.distributed "
                           "has one process group per process): shut it down first (llm.shutdown(), or "
                           "`with LLM(...) as llm:`)")


def close_group(tp: TPGroup | None = None) -> None:
    """Leave the process group: `tp`'s only (nothing when a newer one replaced it), or any."""
    if dist.is_initialized() and (tp is None or tp.generation == _generation):
        dist.destroy_process_group()
