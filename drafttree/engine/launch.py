"""Starting an engine over several ranks (tensor parallelism), and the ranks that follow rank 0.

`start_engine(cfg)` is how every engine starts (LLM, the command line, the server). At
tensor_parallel_size 1 it is `Engine(cfg)`. At N > 1 it first checks the size against the
model's config and the devices (no weights read), then either
  - spawns ranks 1..N-1 (torch.multiprocessing, one GPU each; gloo processes on the CPU), which
    meet rank 0 at a free local port, or
  - joins the launch torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT;
    `torchrun --nnodes` for several hosts),
and every rank builds the same engine over its shards. Rank 0 returns its engine, which owns the
scheduler, the tokenizer and the server; its runner sends its commands to the others
(`parallel.commands`). Spawned ranks follow until rank 0 shuts down; under torchrun the caller
runs `follow(engine)` on ranks > 0 (the command line and LLM do).

Failure: rank 0 watches the ranks it spawned, from their start on; one that exits ends the
engine (the build, or the next step, raises TensorParallelError naming it, and if rank 0 is stuck,
e.g. in an NCCL collective that will never finish, the process exits after GRACE_S). Collectives
time out after `cfg.distributed_timeout_s`. A follower that loses rank 0 exits.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, NoReturn

import torch

from drafttree.config import resolve_device
from drafttree.engine.config import EngineConfig
from drafttree.engine.engine import Engine
from drafttree.engine.plan import settings_of, target_config
from drafttree.kernels.triton_jit import dots_run_on
from drafttree.parallel.commands import COMMANDS, NOOP, SHUTDOWN, CommandChannel
from drafttree.parallel.group import (
    Launch,
    TensorParallelError,
    TPGroup,
    check_free,
    close_group,
    free_port,
    init_group,
    torchrun_launch,
)
from drafttree.parallel.shard import check_size
from drafttree.runner.capture import settle_collector
from drafttree.settings import Settings, scope

log = logging.getLogger(__name__)
GRACE_S = 10.0   # after a rank is lost, how long a step stuck in a collective may take to fail


def check_effect(cfg: EngineConfig) -> None:
    """Refuse, before anything loads, a setting that could not take effect on this machine (the
    engine would otherwise run without it): deterministic mode where its kernels cannot run."""
    device = resolve_device(cfg.device)
    if settings_of(cfg).deterministic and not dots_run_on(device):
        source = "deterministic=True" if cfg.deterministic else "DRAFTTREE_DETERMINISTIC=1"
        raise ValueError(f"{source}: deterministic mode's kernels are Triton programs, which run on a CUDA GPU "
                         f"(Ampere or newer) with triton installed, and this engine runs on {device} without them; "
                         "it would decode as without the mode, so it is refused")


def check_launch(cfg: EngineConfig) -> Launch | None:
    """Refuse a bad tensor_parallel_size before anything loads: < 1, not dividing the model's
    heads (or MLP rows, or routed experts), more ranks than GPUs, or not torchrun's WORLD_SIZE;
    a second tensor-parallel engine while one lives in this process; and a setting that cannot
    take effect (`check_effect`). Returns torchrun's launch when the engine joins one."""
    n = cfg.tensor_parallel_size
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {n!r}")
    check_effect(cfg)
    run = torchrun_launch()
    if n == 1:
        return None
    check_free()
    if run is not None and run.world != n:
        raise ValueError(f"tensor_parallel_size {n} but torchrun started {run.world} processes (WORLD_SIZE): "
                         f"give --nproc-per-node (times --nnodes) = {n}")
    check_size(target_config(cfg), n)
    device = resolve_device(cfg.device)
    if device.type == "cuda":
        if device.index is not None:
            raise ValueError(f"device {device}: a tensor-parallel engine puts rank r on the host's GPU r "
                             "(CUDA_VISIBLE_DEVICES chooses which GPUs those are)")
        have = torch.cuda.device_count()
        local = run.local_world if run is not None else n
        if local > have:
            raise ValueError(f"tensor_parallel_size {n} needs {local} GPUs on this host, which has {have}")
    return run


def start_engine(cfg: EngineConfig, tokenizer: Any = None) -> Engine:
    """The engine for `cfg` on this process (rank 0's, or under torchrun this rank's: see `follow`);
    `tokenizer`: the model's, already loaded (`Engine`)."""
    run = check_launch(cfg)
    if cfg.tensor_parallel_size == 1:
        return Engine(cfg, tokenizer=tokenizer)
    device = resolve_device(cfg.device)
    workers: list[mp.process.BaseProcess] = []
    if run is None:
        port = free_port()
        run = _local(0, cfg.tensor_parallel_size, port)
        threads, level, settings = torch.get_num_threads(), logging.getLogger().level, settings_of(cfg)
        workers = spawn_ranks(_rank_main, cfg.tensor_parallel_size, lambda r: (r, cfg, port, threads, level, settings),
                              cfg.distributed_timeout_s)
    tp, watch = None, BuildWatch(workers)
    try:
        tp = init_group(run, device, cfg.distributed_timeout_s)
        engine = Engine(cfg, tp, tokenizer)
    except BaseException as e:
        lost = watch.finish(wait_s=2.0)
        stop_processes(workers, 0.0)
        if tp is not None:   # init_group leaves no group behind when it fails
            close_group(tp)
        if lost is not None and isinstance(e, Exception):
            raise TensorParallelError(f"{lost} while the engines were being built (its error is above)") from e
        raise
    watch.finish()
    if tp.leader:
        Ranks(engine, workers).attach()
    return engine


def _local(rank: int, world: int, port: int) -> Launch:
    """A rank of ranks that meet on this host at `port` (spawned here; GPU = rank)."""
    return Launch(rank, world, rank, f"tcp://127.0.0.1:{port}")


def spawn_ranks(target: Callable[..., None], world: int, args_of: Callable[[int], tuple],
                timeout_s: float = 300.0) -> list[mp.process.BaseProcess]:
    """Ranks 1..world-1 started as fresh processes running target(*args_of(rank)); returns once
    each has started (imported what it runs), or raises at once if one exits before: rank 0
    would otherwise wait out the rendezvous's timeout for a rank that is gone."""
    ctx = mp.get_context("spawn")
    started = [ctx.Event() for _ in range(1, world)]
    procs = [ctx.Process(target=_started, args=(target, started[r - 1], args_of(r)), name=f"drafttree-rank-{r}",
                         daemon=False) for r in range(1, world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    while not all(e.is_set() for e in started):
        gone = [(r, p.exitcode) for r, (p, e) in enumerate(zip(procs, started), 1)
                if p.exitcode is not None and not e.is_set()]
        if gone or time.monotonic() > deadline:
            stop_processes(procs, 0.0)
            if not gone:
                raise RuntimeError(f"tensor parallel: the spawned ranks did not start within {timeout_s:g} s")
            r, code = gone[0]
            raise RuntimeError(
                f"tensor parallel: rank {r} exited (code {code}) before it started. Each rank is a fresh "
                "Python process that first imports the program's main module (multiprocessing's 'spawn'): "
                "a script that creates the engine at its top level must do so under "
                "`if __name__ == \"__main__\":`; the rank's own error is above")
        time.sleep(0.02)
    return procs


def _started(target: Callable[..., None], started: Any, args: tuple) -> None:
    """A spawned rank's entry: say it is running, then run."""
    started.set()
    target(*args)


def _rank_main(rank: int, cfg: EngineConfig, port: int, threads: int, level: int, settings: Settings) -> None:
    """A spawned rank: join, build the same engine under rank 0's settings, follow rank 0, exit
    with its code."""
    logging.basicConfig(level=level or logging.WARNING, format=f"%(levelname)s rank {rank} %(name)s: %(message)s")
    torch.set_num_threads(threads)
    launch = _local(rank, cfg.tensor_parallel_size, port)
    try:
        with scope(settings):
            engine = Engine(cfg, init_group(launch, resolve_device(cfg.device), cfg.distributed_timeout_s))
    except Exception:
        log.exception("rank %d could not start its engine", rank)
        sys.exit(1)
    sys.exit(follow(engine))


def follow(engine: Engine) -> int:
    """Run rank 0's commands on this rank's engine until it shuts down (returns 0). A rank that
    loses rank 0 or fails a command exits the process at once (code 1): a collective it left
    behind may never complete, and tearing down its process group could wait on it."""
    tp = engine.tp
    assert tp is not None and not tp.leader, "rank 0 steps its engine; the other ranks follow it"
    with scope(engine.settings):   # the commands run model code, as rank 0's steps do
        return _follow(engine, tp)


def _follow(engine: Engine, tp: TPGroup) -> int:
    channel, runner = CommandChannel(tp), engine.runner
    settle_collector()   # this process holds this engine until it exits
    while True:
        try:
            name, args, kwargs = channel.receive()
        except Exception as e:
            _stop(f"rank {tp.rank} lost rank 0 ({str(e).splitlines()[0]})")
        if name == SHUTDOWN:
            close_group(tp)
            return 0
        if name == NOOP:
            continue
        if name not in COMMANDS:
            _stop(f"rank {tp.rank}: unknown command {name!r}")
        try:
            getattr(runner, name)(*args, **kwargs)
        except Exception:
            log.exception("rank %d failed running %s", tp.rank, name)
            _stop(f"rank {tp.rank} failed running {name}")
        if name == "capture_next":
            settle_collector()   # as rank 0's server does after each piece of idle work
        runner.collect_phase_times()


def _stop(message: str) -> NoReturn:
    log.error("%s: stopping", message)
    logging.shutdown()
    sys.stderr.flush()
    os._exit(1)


class BuildWatch:
    """The spawned ranks watched while rank 0 builds its engine. A rank that exits then leaves rank
    0 in a collective that gloo fails at once (its error then names the rank) but NCCL waits out
    for `distributed_timeout_s`: if the build has not failed GRACE_S after the loss, the process
    exits saying which rank was lost, as a step stuck after a loss does."""

    def __init__(self, workers: list[mp.process.BaseProcess]) -> None:
        self.workers, self.done, self.lost = workers, threading.Event(), None
        if workers:
            threading.Thread(target=self._watch, name="drafttree-tp-build-watch", daemon=True).start()

    def finish(self, wait_s: float = 0.0) -> str | None:
        """Stop watching; what was lost, looking up to wait_s seconds for a rank that is exiting
        (a collective can fail a moment before the peer's exit is seen)."""
        if self.lost is None and self.workers and wait_s > 0:
            self._look(wait_s)
        self.done.set()
        return self.lost

    def _look(self, timeout: float) -> bool:
        gone = exited_rank(self.workers, timeout)
        if gone is not None and self.lost is None:
            self.lost = gone
        return gone is not None

    def _watch(self) -> None:
        while not self.done.is_set():
            if self._look(1.0):
                break
        if self.done.wait(GRACE_S):
            return
        print(f"drafttree: error: {self.lost} while the engines were being built, and rank 0 waits in a "
              "collective for it: exiting", file=sys.stderr, flush=True)
        os._exit(1)


class Ranks:
    """Rank 0's hold on the others: the command channel, the processes it spawned and their watch."""

    def __init__(self, engine: Engine, workers: list[mp.process.BaseProcess]) -> None:
        self.engine = weakref.ref(engine)
        self.tp: TPGroup = engine.tp
        self.workers = workers
        self.channel = CommandChannel(self.tp)
        self.closing = threading.Event()

    def attach(self) -> None:
        engine = self.engine()
        engine.attach_ranks(self)
        self.channel.start_heartbeat()
        if self.workers:
            threading.Thread(target=self._watch, name="drafttree-tp-watch", daemon=True).start()
        # on garbage collection and at exit, whichever comes first; holds no reference to the engine
        weakref.finalize(engine, self.close)

    def lost(self) -> str | None:
        """What is known lost: a spawned rank that exited (looked at now), or what the heartbeat saw."""
        if self.channel.failure is None and not self.closing.is_set() and self.workers:
            gone = exited_rank(self.workers, 0)
            if gone is not None:
                self.channel.failure = gone
        return self.channel.failure

    def _watch(self) -> None:
        alive = {p.sentinel: p for p in self.workers}
        while alive and not self.closing.is_set():
            if mp.connection.wait(list(alive), timeout=1.0) and not self.closing.is_set():
                self._lost()
                return

    def _lost(self) -> None:
        msg = self.lost()
        log.error("%s: the engine stops", msg)
        stop_processes([w for w in self.workers if w.is_alive()], 0.0)
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline:
            engine = self.engine()
            if engine is None or not engine.in_step or engine.dead is not None:
                return   # idle (its next step raises) or the failure already surfaced
            time.sleep(0.1)
        print(f"drafttree: error: {msg}, and rank 0 is stuck in a step (a collective waits for it): exiting",
              file=sys.stderr, flush=True)
        os._exit(1)

    def close(self, failed: bool = False) -> None:
        if self.closing.is_set():
            return
        self.closing.set()
        self.channel.close(farewell=not failed)
        stop_processes(self.workers, 10.0)
        close_group(self.tp)   # this engine's group only: another engine's may live by now


def exited_rank(workers: list[mp.process.BaseProcess], timeout: float) -> str | None:
    """The first spawned rank seen exited within `timeout` seconds, named with its pid and exit, or None."""
    exited = set(mp.connection.wait([p.sentinel for p in workers], timeout=timeout))
    gone = next((p for p in workers if p.sentinel in exited), None)
    if gone is None:
        return None
    return f"tensor-parallel rank {workers.index(gone) + 1} (pid {gone.pid}) {_exit_text(_exit_code(gone))}"


def _exit_code(p: mp.process.BaseProcess, wait_s: float = 2.0) -> int | None:
    """The exit code of a process whose sentinel is ready. Its sentinel closes a moment before
    the kernel reports the exit, and another thread (a join, the watcher) may be reaping it, in
    which case this thread sees no child until that one records the code: so wait a little."""
    deadline = time.monotonic() + wait_s
    while (code := p.exitcode) is None and time.monotonic() < deadline:
        time.sleep(0.005)
    return code


def _exit_text(code: int | None) -> str:
    return f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"


def stop_processes(procs: list[mp.process.BaseProcess], wait_s: float) -> None:
    """Join each process for up to wait_s seconds in all, then kill what still runs."""
    deadline = time.monotonic() + wait_s
    for p in procs:
        p.join(max(deadline - time.monotonic(), 0.0))
        if p.is_alive():
            p.kill()
            p.join(5.0)


def run_ranks(fn: Callable[..., Any], world: int, device: str | None, timeout_s: float, *args: Any) -> Any:
    """Run fn(tp, *args) on `world` ranks, each the same code (no commands; the phase benchmark):
    spawned here, or on torchrun's ranks. Returns rank 0's result (None elsewhere)."""
    dev = resolve_device(device)
    run = torchrun_launch()
    workers: list[mp.process.BaseProcess] = []
    if run is None:
        port = free_port()
        run = _local(0, world, port)
        workers = spawn_ranks(_same_code, world, lambda r: (r, world, port, dev, timeout_s, fn, args), timeout_s)
    try:
        tp = init_group(run, dev, timeout_s)
        out = fn(tp, *args)
        return out if tp.leader else None
    finally:
        close_group()
        stop_processes(workers, 60.0)


def _same_code(rank: int, world: int, port: int, device: torch.device, timeout_s: float,
               fn: Callable[..., Any], args: tuple) -> None:
    tp = init_group(_local(rank, world, port), device, timeout_s)
    try:
        fn(tp, *args)
    finally:
        close_group()
