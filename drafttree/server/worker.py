"""The engine thread: the only thread that touches the engine.

The event loop sends commands (add, abort, stop) through a thread-safe queue; the engine thread
answers each request with snapshots on the request's asyncio queue through
`loop.call_soon_threadsafe`. It blocks on the command queue whenever the engine has nothing to do.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import abc
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from drafttree.engine.engine import Engine
from drafttree.engine.sequence import Sequence
from drafttree.engine.text import Tokenized
from drafttree.parallel.group import TensorParallelError
from drafttree.runner.capture import settle_collector, thaw_collector
from drafttree.runner.logit_rows import Logprobs
from drafttree.sampling import SamplingParams
from drafttree.server.metrics import ServerMetrics
from drafttree.settings import scope

log = logging.getLogger(__name__)


class Prefix(abc.Sequence):
    """The first n items of a list that only grows (a request's output ids, its log-probabilities),
    as a snapshot holds it: taken in O(1) where a copy would cost O(n) at every step of a long
    request. Read on the event loop while the engine thread appends: a list's slice is atomic."""
    __slots__ = ("_items", "_n")

    def __init__(self, items: list, n: int | None = None) -> None:
        self._items, self._n = items, len(items) if n is None else n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(self._n)
            if step == 1:
                return self._items[start:stop]
            return [self._items[j] for j in range(start, stop, step)]
        if not -self._n <= i < self._n:
            raise IndexError(i)
        return self._items[i % self._n]

    def __iter__(self):
        return iter(self._items[:self._n])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, abc.Sequence) and len(other) == self._n and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Prefix({self._items[:self._n]!r})"


@dataclass(frozen=True)
class Admitted:
    prompt_ids: tuple[int, ...]

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)


@dataclass(frozen=True)
class Failed:
    """The engine refused the request (`bad_request`: a bad prompt, answered as a 400 naming
    `param` when known) or failed while running it (a 500)."""
    message: str
    bad_request: bool = False
    param: str | None = None


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class TokenBudget:
    """How many tokens a request may generate, decided once its prompt is tokenized: `requested`
    (what the client sent as `field`), refused when prompt + requested pass the context, as vLLM
    does; else `default`, clamped to the room the prompt leaves (None: all of it)."""
    requested: int | None
    default: int | None = None
    field: str = "max_tokens"

    def resolve(self, prompt_tokens: int, max_model_len: int) -> int:
        room = max_model_len - prompt_tokens
        if self.requested is None:
            return room if self.default is None else min(self.default, room)
        if self.requested > room:
            raise BadRequest(f"this model's context holds {max_model_len} tokens, but the prompt has "
                             f"{prompt_tokens} and {self.field} asks for {self.requested} more "
                             f"({prompt_tokens + self.requested} in all): lower {self.field} to at most "
                             f"{room} or shorten the prompt", param=self.field)
        return self.requested


@dataclass(frozen=True)
class ChoiceSnapshot:
    """One choice of a request (n > 1: one of n) after an engine step. `text` is its whole
    output so far; `logprobs`, where asked, one entry per output token (`Sequence.logprobs`)."""
    index: int
    text: str
    completion_tokens: int
    finish_reason: str | None = None
    token_ids: Prefix | None = None   # the output's ids, for requests that asked (tool calls, logprobs)
    logprobs: Prefix | None = None    # of Logprobs
    stop_reason: int | str | None = None   # the stop token id or stop string that ended it (not EOS)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class Snapshot:
    """A request's state after one engine step: its choices in index order, and what they share
    (the speculation's statistics over all of them; the prompt's log-probabilities, where asked,
    per prompt token after the first)."""
    choices: tuple[ChoiceSnapshot, ...]
    rounds: int = 0
    mean_accept_length: float = 0.0
    prompt_logprobs: tuple[Logprobs, ...] | None = None

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices)

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)

    @classmethod
    def of(cls, seq: Sequence, with_ids: bool) -> "Snapshot":
        """The request of `seq` (any of its choices) as it stands; `with_ids`: each choice's
        token ids (always where log-probabilities were asked: their tokens)."""
        out = []
        for c in seq.choices:
            ids = Prefix(c.output_ids) if with_ids or c.logprobs is not None else None
            out.append(ChoiceSnapshot(c.index, c.text, len(c.output_ids), (c.finish_reason or "stop") if c.finished
                                      else None, ids, None if c.logprobs is None else Prefix(c.logprobs),
                                      c.stop_reason if c.finished else None))
        # the statistics are read once the request ends: not counted at every step of a long one
        st = seq.request_stats if seq.all_finished else None
        first = seq.choices[0]
        return cls(tuple(out), 0 if st is None else st.rounds, 0.0 if st is None else st.mean_accept_length,
                   None if first.prompt_logprobs is None else tuple(first.prompt_logprobs))


Message = Admitted | Failed | Snapshot
Deliver = Callable[[Message], None]


class EngineError(RuntimeError):
    pass


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int] | Tokenized
    params: SamplingParams
    deliver: Deliver
    budget: TokenBudget | None = None   # None: params.max_tokens as given
    with_ids: bool = False              # snapshots carry the output's token ids


@dataclass
class _Abort:
    request_id: str


_STOP = object()
IDLE_CHECK_S = 1.0
TOKENIZE_THREADS = 2   # prompts tokenized at once (the tokenizer releases Python's lock)


class RequestHandle:
    """The event loop's side of one admitted request."""

    def __init__(self, worker: EngineWorker, request_id: str, prompt_ids: tuple[int, ...],
                 q: asyncio.Queue[Message]) -> None:
        self.worker, self.request_id, self.prompt_ids = worker, request_id, prompt_ids
        self._queue = q
        self.finished = False

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    async def next(self) -> Snapshot:
        """The newest snapshot: waits for one, then skips any older ones already queued."""
        msgs = [await self._queue.get()]
        while not self._queue.empty():
            msgs.append(self._queue.get_nowait())
        for m in msgs:
            if isinstance(m, Failed):
                self.finished = True
                raise EngineError(m.message)
        snap = msgs[-1]
        assert isinstance(snap, Snapshot)
        self.finished = snap.finished
        return snap

    async def aclose(self) -> None:
        self.abort()

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.worker.abort(self.request_id)


class EngineWorker:
    def __init__(self, engine: Engine, metrics: ServerMetrics | None = None,
                 on_fatal: Callable[[str], None] | None = None) -> None:
        """`on_fatal(message)`: called (on the engine thread) when the engine stops for good (a
        tensor-parallel rank lost): the thread fails every request and ends; the server should too."""
        self.engine = engine
        self.on_fatal = on_fatal
        self.fatal: str | None = None
        engine.stream_text = True   # deltas are read from seq.text after every step
        self.metrics = metrics
        self._cmds: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._live: dict[str, tuple[Sequence, Deliver]] = {}   # engine thread only
        self._with_ids: set[str] = set()                        # engine thread only
        self._counted: dict[str, set[Sequence]] = {}            # choices whose end was counted, by request
        self._thread: threading.Thread | None = None
        # prompts' text is tokenized here, not on the engine's thread, where the running requests'
        # rounds would wait for it (a 27k-token prompt: 37 ms on two CPU cores)
        self._tokenizers = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="drafttree-tokenize")
        # Written by the engine thread after every command batch and step; read anywhere.
        self.num_running = 0
        self.num_waiting = 0
        self.num_live = 0

    # -- event loop side ---------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="drafttree-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float | None = 30.0) -> None:
        if self._thread is not None:
            self._cmds.put(_STOP)
            self._thread.join(timeout)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def submit(self, request_id: str, prompt: str | list[int] | Tokenized, params: SamplingParams,
                     budget: TokenBudget | None = None, with_ids: bool = False) -> RequestHandle:
        """Queue a request; returns once the engine accepted it. Raises BadRequest (a ValueError)
        if it refused. `budget` sets params.max_tokens from the prompt's length; `with_ids`: its
        snapshots carry the output's token ids."""
        if not self.alive:
            raise EngineError(self.fatal or "the engine is not running")
        loop = asyncio.get_running_loop()
        if isinstance(prompt, str) and self.engine.tokenizer is not None:
            try:   # refused as the engine's thread refuses a prompt it cannot read
                prompt = await loop.run_in_executor(self._tokenizers, self.engine.text.tokenize, prompt)
            except ValueError as e:
                raise BadRequest(str(e), getattr(e, "param", None)) from None
            except Exception as e:
                raise EngineError(f"{type(e).__name__}: {e}") from e
        q: asyncio.Queue[Message] = asyncio.Queue()

        def deliver(msg: Message) -> None:
            try:
                loop.call_soon_threadsafe(q.put_nowait, msg)
            except RuntimeError:   # the loop is closed: nobody is listening any more
                pass

        self._cmds.put(_Add(request_id, prompt, params, deliver, budget, with_ids))
        try:
            first = await q.get()
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        if isinstance(first, Failed):
            if first.bad_request:
                raise BadRequest(first.message, first.param)
            raise EngineError(first.message)
        assert isinstance(first, Admitted)
        return RequestHandle(self, request_id, first.prompt_ids, q)

    def abort(self, request_id: str) -> None:
        self._cmds.put(_Abort(request_id))

    # -- engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        with scope(self.engine.settings):   # a new thread starts outside any scope (`drafttree.settings`)
            settle_collector()   # built and warmed up: what is alive now lives as long as the engine
            try:
                self._loop()
            finally:
                thaw_collector()

    def _loop(self) -> None:
        eng = self.engine
        while True:
            if eng.has_unfinished():
                cmds = []
            elif eng.graphs_pending and self._cmds.empty():
                # idle: one graph left for later (a request arriving meanwhile waits for that capture)
                if not self._capture_later():
                    return
                cmds = []
            else:
                cmds = self._wait()
            if eng.failure is not None:   # a tensor-parallel rank was lost while idle
                self._stop_for_good(eng.failure)
                return
            while True:
                try:
                    cmds.append(self._cmds.get_nowait())
                except queue.Empty:
                    break
            for cmd in cmds:
                if cmd is _STOP:
                    self._fail_all("the server is shutting down")
                    return
                self._handle(cmd)
            if eng.has_unfinished() and not self._step():
                return
            self._publish()

    def _handle(self, cmd: object) -> None:
        if isinstance(cmd, _Add):
            try:
                ids, text = self.engine.read_prompt(cmd.prompt, cmd.params)
                self.engine.check_prompt(ids)
                params = cmd.params
                if cmd.budget is not None:
                    params = replace(params, max_tokens=cmd.budget.resolve(len(ids), self.engine.max_model_len))
                # the ids as read: not converted and checked against the vocabulary a second time
                seq = self.engine.add_request(Tokenized(text, ids), params, request_id=cmd.request_id)
            except ValueError as e:
                cmd.deliver(Failed(str(e), bad_request=True, param=getattr(e, "param", None)))
                return
            except Exception as e:
                log.exception("add_request failed")
                cmd.deliver(Failed(f"{type(e).__name__}: {e}"))
                return
            self._live[cmd.request_id] = (seq, cmd.deliver)
            if cmd.with_ids:
                self._with_ids.add(cmd.request_id)
            cmd.deliver(Admitted(tuple(seq.prompt_ids)))
        elif isinstance(cmd, _Abort):
            entry = self._live.pop(cmd.request_id, None)
            self._with_ids.discard(cmd.request_id)
            self._counted.pop(cmd.request_id, None)
            if entry is not None:
                self.engine.abort(entry[0])
                if self.metrics is not None:
                    self.metrics.request_finished("abort")

    def _wait(self) -> list[object]:
        """The next command; idle, the engine's health is looked at every IDLE_CHECK_S."""
        try:
            return [self._cmds.get(timeout=IDLE_CHECK_S)]
        except queue.Empty:
            return []

    def _stop_for_good(self, message: str) -> None:
        self.fatal = message
        log.critical("%s", message)
        self._fail_all(message)
        if self.on_fatal is not None:
            self.on_fatal(message)

    def _capture_later(self) -> bool:
        """One graph set left for later; False when the engine stopped for good."""
        try:
            self.engine.capture_later()
        except TensorParallelError as e:
            self._stop_for_good(str(e))
            return False
        settle_collector()   # what the piece compiled and captured stays too
        return True

    def _step(self) -> bool:
        """One engine step and its snapshots; False when the engine stopped for good."""
        try:
            out = self.engine.step()
        except TensorParallelError as e:
            self._stop_for_good(str(e))
            return False
        except Exception as e:
            log.exception("engine step failed")
            self._fail_all(f"engine step failed: {type(e).__name__}: {e}")
            return True
        touched: dict[str, Sequence] = {}
        for seq, _ in out:
            touched[seq.request_id] = seq
        for rid, seq in touched.items():
            entry = self._live.get(rid)
            if entry is None or entry[0] not in seq.choices:
                continue
            first, deliver = entry
            for c in seq.choices:   # each choice once, as it finishes (vLLM counts n > 1's choices alike)
                if c.finished and c not in self._counted.setdefault(rid, set()):
                    self._counted[rid].add(c)
                    if self.metrics is not None:
                        self.metrics.request_finished(c.finish_reason, c)
            snap = Snapshot.of(first, rid in self._with_ids)
            if snap.finished:
                del self._live[rid]
                self._with_ids.discard(rid)
                self._counted.pop(rid, None)
            deliver(snap)
        return True

    def _fail_all(self, message: str) -> None:
        for seq, deliver in self._live.values():
            try:
                self.engine.abort(seq)
            except Exception:
                log.exception("abort failed")
            deliver(Failed(message))
        self._live.clear()
        self._with_ids.clear()
        self._counted.clear()
        self._publish()

    def _publish(self) -> None:
        if self.metrics is not None:
            self.metrics.sync(self.engine)
        self.num_running = len(self.engine.running)
        self.num_waiting = len(self.engine.waiting)
        self.num_live = len(self._live)
