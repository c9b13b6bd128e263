"""The settings an operator may change without touching the code: which kernel families run, the
block shapes of the fused projections, torch.compile, and the cache directory.

Each field has one DRAFTTREE_* environment variable. The process default is read once: the first
`current()` outside any scope parses the environment with `Settings.from_env()`; `install()`
replaces it. Kernels read `current()`, never the environment: the settings of this thread's
innermost scope (`scope(settings)`, or `using(**changes)` over the current ones), else the
process default. A scope holds in its own thread only: another thread, a new one included, sees
the process default until it enters a scope of its own. Each engine runs its model code
(construction, steps, warm-up, a follower rank's commands, the server's engine thread) in a scope
of its own settings, so two engines with different settings in one process keep theirs; the
ranks an engine spawns build theirs under its settings, not their environment's. CUDA graphs
keep the kernels chosen at their capture.

    DRAFTTREE_ATTN_KERNEL=0   attention, rope and the KV write by the torch ops
    DRAFTTREE_GEMV=0          every projection by the torch ops (cuBLAS)
    DRAFTTREE_GEMM=0          the few-row tiles off (verify and draft rows by the torch ops)
    DRAFTTREE_MOE_KERNEL=0    routed experts by the torch forms, not the grouped GEMMs
    DRAFTTREE_PDL=0           no programmatic dependent launch (Hopper or newer)
    DRAFTTREE_DETERMINISTIC=1 a token's logits the same bits in every phase and batch (`--deterministic`)
    DRAFTTREE_BLOCKS=f.json   block shapes of a sweep (benchmarks/gemv_bench.py --out)
    DRAFTTREE_COMPILE=0|1|cpu torch.compile of the small fused pieces: off, CUDA, CUDA and CPU
                              (unset: 0 for `generate`, which installs that default)
    DRAFTTREE_CACHE=dir       converted models and compiled pieces (default ~/.cache/drafttree)
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PREFIX = "DRAFTTREE_"
COMPILE_MODES = ("0", "1", "cpu")
_WARNED: set[str] = set()   # unknown DRAFTTREE_* names already logged


def _flag(name: str, raw: str) -> bool:
    if raw not in ("0", "1"):
        raise ValueError(f"{name}={raw!r}: expected 0 (off) or 1 (on)")
    return raw == "1"


def _compile_mode(name: str, raw: str) -> str:
    if raw not in COMPILE_MODES:
        raise ValueError(f"{name}={raw!r}: expected 0 (off), 1 (CUDA tensors) or cpu (CUDA and CPU tensors)")
    return raw


def _blocks_file(name: str, raw: str) -> str:
    if not Path(raw).is_file():
        raise ValueError(f"{name}={raw}: no such file (a sweep's block shapes: benchmarks/gemv_bench.py --out)")
    return raw


def _directory(name: str, raw: str) -> Path:
    return Path(raw).expanduser()


def _var(name: str, parse: Callable[[str, str], Any], **kw: Any) -> Any:
    return field(metadata={"env": name, "parse": parse}, **kw)


@dataclass(frozen=True)
class Settings:
    # The Triton attention kernels (few-row attention; rope, q/k norm and the KV write) where they
    # run; off: the torch ops (cuBLAS matmuls around a fused softmax, SDPA, indexed writes).
    attn_kernel: bool = _var("DRAFTTREE_ATTN_KERNEL", _flag, default=True)
    # The fused projections of 16-bit models (the one-token GEMVs, and with `gemm` the few-row
    # tiles, each with its norm or SiLU·up); off: every projection by the torch ops.
    gemv: bool = _var("DRAFTTREE_GEMV", _flag, default=True)
    # The few-row tiles (a verify's, a draft block's rows; the fp8 drafter's weights); off: those
    # rows by the torch ops (an fp8 drafter's weights widened for them), the one-token GEMVs kept.
    gemm: bool = _var("DRAFTTREE_GEMM", _flag, default=True)
    # Routed experts of 16-bit MoE models as grouped GEMMs over expert-sorted pairs; off: the
    # torch forms (gathered weights, every expert, or sorted with a read-back).
    moe_kernel: bool = _var("DRAFTTREE_MOE_KERNEL", _flag, default=True)
    # Programmatic dependent launch on Hopper or newer: a kernel's programs start while the one
    # before still runs and load their weights; off: each kernel waits for the one before.
    pdl: bool = _var("DRAFTTREE_PDL", _flag, default=True)
    # Deterministic mode: every projection, attention and norm sums in an order fixed per token,
    # never per forward width or batch (`kernels.dispatch`), so speculative decoding gives the
    # bits plain decoding gives; off: the fastest kernel per width. Dense targets only.
    deterministic: bool = _var("DRAFTTREE_DETERMINISTIC", _flag, default=False)
    # A JSON file of block shapes per kernel and weight size from `benchmarks/gemv_bench.py --out`,
    # applied over the code's tables (tuned on an H200) for another GPU or model.
    blocks: str | None = _var("DRAFTTREE_BLOCKS", _blocks_file, default=None)
    # torch.compile of the small fused pieces (norms, rope, masks, the sampler, a round's
    # bookkeeping): "1" on CUDA tensors, "0" never, "cpu" on CPU tensors too.
    compile: str = _var("DRAFTTREE_COMPILE", _compile_mode, default="1")
    # Where converted models (the default model's GGUF) are kept.
    cache: Path = _var("DRAFTTREE_CACHE", _directory, default_factory=lambda: Path.home() / ".cache" / "drafttree")

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.type == "bool" and not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"{f.name} ({f.metadata['env']}): expected a bool, got {getattr(self, f.name)!r}")
        _compile_mode(f"compile ({env_name('compile')})", self.compile)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        """The settings of the DRAFTTREE_* variables in `environ` (the process's environment unless
        given); an unset or empty variable keeps the default, a bad value raises ValueError naming
        the variable, and a DRAFTTREE_* name that is no setting is logged (a typo, or a switch that
        no longer exists)."""
        env = os.environ if environ is None else environ
        values = {}
        for f in fields(cls):
            raw = env.get(f.metadata["env"], "")
            if raw != "":
                values[f.name] = f.metadata["parse"](f.metadata["env"], raw)
        known = {f.metadata["env"] for f in fields(cls)}
        unknown = sorted(k for k in env if k.startswith(PREFIX) and k not in known and k not in _WARNED)
        if unknown:
            _WARNED.update(unknown)
            log.warning("ignoring %s: not a drafttree setting (the settings: %s)", ", ".join(unknown),
                        ", ".join(sorted(known)))
        return cls(**values)

    def replace(self, **changes: Any) -> "Settings":
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        """Field name -> value, JSON-ready (for bench results)."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    def describe(self) -> str:
        """One line, `name=value` per field (on/off for switches)."""
        return " ".join(f"{name}={_shown(value)}" for name, value in self.as_dict().items())


def env_name(field_name: str) -> str:
    """The environment variable of a field."""
    return next(f.metadata["env"] for f in fields(Settings) if f.name == field_name)


def _plain(value: Any) -> Any:
    return str(value) if isinstance(value, Path) else value


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return "-" if value is None else str(value)


_current: Settings | None = None   # the process default (None: not read from the environment yet)
# This thread's innermost scope. A thread-local rather than a ContextVar: torch.compile traces a
# thread-local's attributes (and guards on them), and a forward it traces reads the settings.
_scoped = threading.local()


def current() -> Settings:
    """The settings in force: this thread's innermost scope's, else the process default."""
    inner = getattr(_scoped, "settings", None)
    return inner if inner is not None else process_default()


def process_default() -> Settings:
    """The settings outside any scope: those installed, else the environment's, read now and kept."""
    global _current
    if _current is None:
        _current = Settings.from_env()
    return _current


def install(settings: Settings) -> Settings:
    """Make `settings` the process default; returns the one it replaces. Active scopes keep theirs."""
    global _current
    before = process_default()
    _current = settings
    return before


@contextlib.contextmanager
def scope(settings: Settings) -> Iterator[Settings]:
    """`settings` in force for the block, in this thread only."""
    outer = getattr(_scoped, "settings", None)
    _scoped.settings = settings
    try:
        yield settings
    finally:
        _scoped.settings = outer


def using(**changes: Any) -> contextlib.AbstractContextManager[Settings]:
    """The current settings with `changes` for the block, e.g. `with using(attn_kernel=False):`."""
    return scope(current().replace(**changes))
