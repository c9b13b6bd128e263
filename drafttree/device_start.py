"""The GPU's start, begun at launch beside the imports.

A process's first CUDA call starts the driver and creates the device's primary context: seconds
on a machine whose driver keeps no GPU initialised between processes, all of them before the
first weight can load. The `drafttree` command begins both in a thread of their own as it starts
(`begin`), through the driver's own library, whose calls run without Python's lock, so that torch
and the engine's modules import meanwhile; torch's runtime then finds the driver started and the
primary context it uses already made. Only for a process that will use the first visible GPU
(one rank, or torchrun's rank 0, and no `--device` naming another device or the CPU).

This module imports the standard library alone: the command imports it before torch."""
from __future__ import annotations

import ctypes
import os
import threading
import time
from dataclasses import dataclass, field

ENV = "DRAFTTREE_EARLY_DEVICE"   # "0": leave the GPU's start to torch's first call

LAUNCHED_AT: float | None = None   # time.perf_counter() when the command began (None: not the command)


@dataclass
class DeviceStart:
    """The driver's start and device 0's primary context, in a thread (`wait` for it)."""
    began: float = field(default_factory=time.perf_counter)
    seconds: float | None = None   # how long it took, once done
    error: str | None = None       # why it did not (no driver, no GPU): torch's own start then says
    _done: threading.Event = field(default_factory=threading.Event, repr=False)

    def start(self) -> "DeviceStart":
        threading.Thread(target=self._run, name="drafttree-device-start", daemon=True).start()
        return self

    def _run(self) -> None:
        try:
            self.error = _retain_primary_context()
        except Exception as e:   # anything here only means torch starts the GPU itself, later
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.seconds = time.perf_counter() - self.began
            self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Whether it is done (waiting at most `timeout` seconds)."""
        return self._done.wait(timeout)


_started: DeviceStart | None = None


def _retain_primary_context() -> str | None:
    """cuInit, then device 0's primary context retained for the process's life (torch's runtime
    uses that context). None when done, else why not."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return f"no CUDA driver ({e})"
    rc = lib.cuInit(0)
    if rc != 0:
        return f"cuInit returned {rc}"
    dev = ctypes.c_int()
    rc = lib.cuDeviceGet(ctypes.byref(dev), 0)
    if rc != 0:
        return f"cuDeviceGet returned {rc}"
    ctx = ctypes.c_void_p()
    rc = lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
    return None if rc == 0 else f"cuDevicePrimaryCtxRetain returned {rc}"


def wanted(argv: list[str], environ: dict[str, str] | None = None) -> bool:
    """Whether a command with these arguments will run on the first visible GPU, as far as the
    arguments and environment say before anything imports."""
    env = os.environ if environ is None else environ
    if env.get(ENV, "1") == "0" or env.get("CUDA_VISIBLE_DEVICES") == "":
        return False
    if env.get("LOCAL_RANK", "0") != "0":   # torchrun's other ranks use other GPUs
        return False
    device = None
    for i, arg in enumerate(argv):
        if arg == "--device" and i + 1 < len(argv):
            device = argv[i + 1]
        elif arg.startswith("--device="):
            device = arg.split("=", 1)[1]
    return device is None or device in ("cuda", "cuda:0")


def begin(argv: list[str]) -> DeviceStart | None:
    """Begin the GPU's start for a command that will use it (see `wanted`); at most once."""
    global _started
    if _started is None and wanted(argv):
        _started = DeviceStart().start()
    return _started


def started() -> DeviceStart | None:
    """The start `begin` began in this process, if any."""
    return _started
