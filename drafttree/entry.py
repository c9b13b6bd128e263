"""The `drafttree` command's entry point. Python imports torch and the engine's modules, a GPU's
driver starts and `generate` reads the model's tokenizer before an engine reports its first
start-up stage: seconds, on a GPU machine more than the stages after them. A command that starts
an engine says so at once and every EVERY_S seconds after until the engine's own start-up lines
begin (`drafttree.engine.startup`, which report every stage from then on), and the GPU's start
begins beside the imports (`drafttree.device_start`). This module imports nothing of drafttree's
but that standard-library one until then, so that its first line comes before those imports.
As a process (`command`), `generate` ends as soon as its output is written: the interpreter's
teardown (the CUDA context, every module) would add up to a second after the answer."""
from __future__ import annotations

import logging
import os
import sys
import threading
import time

from drafttree import device_start

EVERY_S = 2.0
STARTUP_LOGGER = "drafttree.engine.startup"
ENGINE_COMMANDS = ("generate", "serve")


class _Seen(logging.Handler):
    """Sets `seen` at the engine's first start-up line."""

    def __init__(self, seen: threading.Event) -> None:
        super().__init__()
        self.seen = seen

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.set()


def announce(command: str, every_s: float = EVERY_S) -> threading.Event:
    """Say that `command` starts, then every `every_s` (seconds counted from the launch, or from
    now) until the engine's first start-up line or until the returned event is set."""
    seen = threading.Event()
    logger = logging.getLogger(STARTUP_LOGGER)
    handler = _Seen(seen)
    logger.addHandler(handler)
    t0 = device_start.LAUNCHED_AT or time.perf_counter()
    print(f"drafttree: start-up: {command}: importing torch and drafttree", file=sys.stderr, flush=True)

    def tick() -> None:
        while not seen.wait(every_s):
            print(f"drafttree: start-up: starting (imports, the device, the tokenizer, the model), "
                  f"{time.perf_counter() - t0:.0f} s so far", file=sys.stderr, flush=True)
        logger.removeHandler(handler)

    threading.Thread(target=tick, name="drafttree-start", daemon=True).start()
    return seen


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    asks_help = any(a in ("-h", "--help") for a in argv)
    first_rank = os.environ.get("RANK", "0") == "0"   # under torchrun, rank 0 speaks for all
    engine = bool(argv) and argv[0] in ENGINE_COMMANDS and not asks_help
    if engine:
        device_start.LAUNCHED_AT = time.perf_counter()
        device_start.begin(argv[1:])
    seen = announce(argv[0]) if engine and first_rank else None
    try:
        from drafttree.cli import main as cli_main
        return cli_main(argv)
    finally:
        device_start.LAUNCHED_AT = None   # an engine built later in this process did not launch with it
        if seen is not None:
            seen.set()


def command() -> None:
    """The process's entry (the console script, `python -m drafttree`): `main`, then a
    `generate` that returned exits at once, its output and logs flushed."""
    rc = main()
    if sys.argv[1:2] == ["generate"]:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc if isinstance(rc, int) else 1)
    raise SystemExit(rc)
