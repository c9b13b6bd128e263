"""Where compiled kernels are kept between runs, and what they depend on.

Triton's kernels (the hand-written ones and Inductor's) and Inductor's compiled graphs live under
drafttree's cache (settings.cache, DRAFTTREE_CACHE), in `compiled/<platform key>/triton` and
`.../inductor`. Both compilers key their entries by source and options already; the directory's
key adds what they may not see: the GPU, the driver, the torch, Triton and CUDA versions and
drafttree's release, so that a machine whose driver or libraries changed starts from an empty
directory instead of one it may misread. TRITON_CACHE_DIR or TORCHINDUCTOR_CACHE_DIR set in the
environment win (an operator's own cache).

`platform()` is also part of every measured cost table's key (`engine.caches`)."""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import platform as host
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from drafttree.settings import current

TRITON_ENV = "TRITON_CACHE_DIR"
INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"
COMPILED = "compiled"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=None)
def _nvidia_driver() -> str | None:
    """The kernel driver's version line (Linux), without initialising CUDA."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return None
    return text.splitlines()[0].strip() if text else None


@functools.lru_cache(maxsize=None)
def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return host.processor() or host.machine()


def platform(device: torch.device | str | None = None) -> dict[str, Any]:
    """What compiled kernels and measured timings depend on besides the code: the device (a GPU's
    name and capability; the CPU's model and torch's thread count), the driver, torch, Triton,
    CUDA and drafttree's release."""
    dev = torch.device(device) if device is not None else \
        torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out: dict[str, Any] = {"torch": torch.__version__, "triton": _version("triton"), "cuda": torch.version.cuda,
                           "drafttree": _version("drafttree")}
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        out["device"] = torch.cuda.get_device_name(index)
        out["capability"] = list(torch.cuda.get_device_capability(index))
        out["driver"] = _nvidia_driver() or str(torch._C._cuda_getDriverVersion())
    else:
        out["device"] = f"cpu: {_cpu_name()}"
        out["threads"] = torch.get_num_threads()
    return out


def digest(value: Any, n: int = 16) -> str:
    """A short stable hash of a JSON-able value."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:n]


def compiled_dir(device: torch.device | str | None = None, root: Path | None = None) -> Path:
    """The directory of this platform's compiled kernels (under settings.cache unless `root`)."""
    return (root or current().cache) / COMPILED / digest(platform(device))


def install(device: torch.device | str | None = None) -> dict[str, str]:
    """Point Triton and Inductor at this platform's directories (unless the environment names
    their own), before anything compiles; returns the two directories in force. Once both are
    set (by an earlier call or by the user), nothing is computed again: every compiled piece's
    first compilation calls here."""
    if TRITON_ENV in os.environ and INDUCTOR_ENV in os.environ:
        return {"triton": os.environ[TRITON_ENV], "inductor": os.environ[INDUCTOR_ENV]}
    base = compiled_dir(device)
    triton_dir = os.environ.setdefault(TRITON_ENV, str(base / "triton"))
    inductor_dir = os.environ.setdefault(INDUCTOR_ENV, str(base / "inductor"))
    if not (base / "platform.json").is_file() and (triton_dir.startswith(str(base))
                                                  or inductor_dir.startswith(str(base))):
        base.mkdir(parents=True, exist_ok=True)
        (base / "platform.json").write_text(json.dumps(platform(device), indent=1))
    return {"triton": triton_dir, "inductor": inductor_dir}


@dataclass
class TritonWatch:
    """Triton's compilations in this process, per kernel: each first use of a specialization (a new
    set of constants, dtypes or integer classes) compiles it, or loads it from the cache
    directory (milliseconds); `seconds` is the host's time between Triton's hooks around it."""
    first_uses: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    _began: dict[tuple[str, str], float] = field(default_factory=dict)

    def snapshot(self) -> tuple[dict[str, int], dict[str, float]]:
        return dict(self.first_uses), dict(self.seconds)

    def since(self, snap: tuple[dict[str, int], dict[str, float]], top: int = 3) -> str:
        """", Triton: N first uses in S s (most: kernel nx s, ...)" since `snap`, if any."""
        uses = {k: n - snap[0].get(k, 0) for k, n in self.first_uses.items() if n > snap[0].get(k, 0)}
        secs = {k: self.seconds[k] - snap[1].get(k, 0.0) for k in uses}
        if not uses:
            return ""
        most = sorted(secs, key=secs.get, reverse=True)[:top]
        return (f", Triton: {sum(uses.values())} first uses in {sum(secs.values()):.1f} s (most: "
                + ", ".join(f"{k} {uses[k]}x {secs[k]:.1f} s" for k in most) + ")")

    def before(self, **kw: Any) -> None:
        self._began[_name(kw), str(kw.get("key"))] = time.perf_counter()

    def after(self, **kw: Any) -> None:
        name = _name(kw)
        began = self._began.pop((name, str(kw.get("key"))), None)
        if began is not None:
            self.first_uses[name] = self.first_uses.get(name, 0) + 1
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - began


def _name(hook_kwargs: dict[str, Any]) -> str:
    fn = hook_kwargs.get("fn")
    return str(getattr(fn, "name", None) or getattr(fn, "__name__", None) or "?")


TRITON = TritonWatch()


def watch_triton() -> None:
    """Install `TRITON`'s counting in Triton's compile hooks, once (hooks set before are kept and
    called first; their answer to the first — skip this compilation — stands)."""
    try:
        from triton import knobs
    except ImportError:   # a Triton without knobs: nothing counted
        return
    rt = knobs.runtime
    if getattr(rt.jit_cache_hook, "_drafttree", False):
        return
    earlier_pre, earlier_post = rt.jit_cache_hook, rt.jit_post_compile_hook

    def pre(**kw: Any) -> Any:
        skip = earlier_pre(**kw) if earlier_pre is not None else None
        if not skip:
            _counted(TRITON.before, kw)
        return skip

    def post(**kw: Any) -> Any:
        _counted(TRITON.after, kw)
        return earlier_post(**kw) if earlier_post is not None else None

    pre._drafttree = True   # type: ignore[attr-defined]
    rt.jit_cache_hook, rt.jit_post_compile_hook = pre, post


def _counted(count: Any, kw: dict[str, Any]) -> None:
    """Counting never fails a compilation (a Triton whose hooks pass other arguments counts less)."""
    try:
        count(**kw)
    except Exception:   # noqa: BLE001
        pass


def compile_seconds() -> float:
    """Seconds this process has spent in torch.compile so far (Dynamo's tracing with Inductor's
    compiling or cache lookups under it): what a stage's compiled pieces cost it, cached or not."""
    utils = sys.modules.get("torch._dynamo.utils")   # not imported: nothing compiled (importing it costs ~1 s)
    metrics = getattr(utils, "compilation_time_metrics", None)   # a torch without the counter: 0
    return float(sum(metrics.get("_compile.compile_inner", ()))) if metrics is not None else 0.0


def entries(path: str | Path) -> int:
    """Files under a cache directory (0 if it does not exist): how much a stage compiled."""
    n = 0
    for _, _, files in os.walk(path):
        n += len(files)
    return n
