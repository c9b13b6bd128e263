"""Triton, optional and imported on first use, for the hand-written kernels.

With TRITON_INTERPRET=1 set before triton is first imported, kernels run (slowly) on CPU
tensors: that is how CI tests them.
"""
from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from typing import Any

import torch

from drafttree.settings import current

tl: Any = None  # triton.language, bound by jit_kernel() for `pdl_wait`

_KERNELS: dict[tuple[Callable[..., Any], bool, tuple[str, ...]], Callable[..., Any]] = {}
_DEVICE_FNS: dict[Callable[..., Any], Any] = {}
_TRITON_OK: bool | None = None


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def interpreting() -> bool:
    """Whether kernels run under Triton's interpreter (TRITON_INTERPRET, Triton's own variable,
    read at each launch: tests turn it on and off)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def triton_importable() -> bool:
    global _TRITON_OK
    if _TRITON_OK is None:
        try:
            import triton  # noqa: F401
            _TRITON_OK = True
        except ImportError:
            _TRITON_OK = False
    return _TRITON_OK


def kernels_run_on(device: torch.device | str) -> bool:
    """CUDA with triton installed, or CPU/CUDA under TRITON_INTERPRET=1 (slow; for tests)."""
    dev = torch.device(device)
    cuda = dev.type == "cuda" and torch.cuda.is_available()
    if not (cuda or (interpreting() and dev.type in ("cpu", "cuda"))):
        return False
    return triton_importable()


@functools.lru_cache(maxsize=None)
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def capability(device: torch.device | str) -> tuple[int, int]:
    """The compute capability of a CUDA device."""
    return _capability(torch.device(device).index)


def dots_run_on(device: torch.device | str) -> bool:
    """`kernels_run_on`, for kernels with `tl.dot` in 16-bit floats: on CUDA, Ampere or newer
    (older GPUs keep the torch ops)."""
    dev = torch.device(device)
    if not kernels_run_on(dev):
        return False
    return dev.type != "cuda" or interpreting() or _capability(dev.index) >= (8, 0)


@functools.lru_cache(maxsize=None)
def _triton_has_pdl() -> bool:
    """Whether this Triton has the wait and launch instructions and the `launch_pdl` option
    (older ones, with the older torch releases the package allows, do not)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra import cuda
    except ImportError:
        return False
    return hasattr(cuda, "gdc_wait") and "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def pdl_on(device: torch.device | str) -> bool:
    """Whether kernels on `device` launch with programmatic dependent launch (`settings.pdl`;
    Hopper or newer, compiled, a Triton that has it): a kernel's programs may then start while its
    predecessor's last ones still run, load what no kernel writes (weights), and wait (`pdl_wait`)
    before anything else."""
    dev = torch.device(device)
    return (current().pdl and dev.type == "cuda" and not interpreting() and torch.cuda.is_available()
            and triton_importable() and _triton_has_pdl() and _capability(dev.index) >= (9, 0))


def pdl_options(device: torch.device | str) -> dict[str, Any]:
    """The launch keywords of a kernel with a `PDL` argument (passed to `pdl_wait`), on `device`."""
    return {"PDL": 1, "launch_pdl": True} if pdl_on(device) else {"PDL": 0}


def device_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a function that kernels call. `jit_kernel` binds it, in the module of each kernel that
    names it, as a Triton function, or as itself for the interpreter: a process runs its kernels
    in one of the two modes (the interpreter is chosen before triton is imported)."""
    fn.device_function = True  # type: ignore[attr-defined]
    return fn


def jit_kernel(fn: Callable[..., Any], interpret: bool,
               do_not_specialize: tuple[str, ...] = ()) -> Callable[..., Any]:
    """`fn` as a Triton kernel (interpreted on CPU when `interpret`), made once. Triton is
    imported here, on first use, and bound as `tl` in the kernel's own module (and in those of
    the `device_function`s it calls).

    `do_not_specialize`: integer arguments Triton should not specialize on (value 1, multiple
    of 16): counts that vary per batch and phase, which would otherwise each compile anew."""
    key = (fn, interpret, do_not_specialize)
    if key not in _KERNELS:   # checked once: this runs at every launch of eager rounds and prefill
        unknown = [name for name in do_not_specialize if name not in inspect.signature(fn).parameters]
        if unknown:
            raise ValueError(f"{fn.__name__} has no argument {unknown}")
        import triton
        import triton.language
        from triton.runtime.interpreter import InterpretedFunction

        fn.__globals__["tl"] = triton.language
        for name, obj in list(fn.__globals__.items()):
            plain = obj.fn if isinstance(obj, triton.JITFunction) else obj
            if inspect.isfunction(plain) and getattr(plain, "device_function", False) is True:
                plain.__globals__["tl"] = triton.language
                if plain not in _DEVICE_FNS:
                    _DEVICE_FNS[plain] = triton.JITFunction(plain)
                fn.__globals__[name] = plain if interpret else _DEVICE_FNS[plain]
        _KERNELS[key] = (InterpretedFunction(fn) if interpret
                         else triton.JITFunction(fn, do_not_specialize=list(do_not_specialize)))
    return _KERNELS[key]


@device_function
def pdl_wait(PDL: tl.constexpr):
    """Under programmatic dependent launch (PDL 1): let the next kernel's programs start, then
    wait until the kernels before this one have finished and their writes are seen. Letting the
    next kernel start before the wait rather than after it made the decode step fastest (H200).
    Every kernel launched with `pdl_options` calls it in every program before it reads or writes
    anything an earlier kernel may touch; before it, only loads of weights. So a wait also covers
    the kernels before the one it waits for. A no-op without PDL (0)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()

