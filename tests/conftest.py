"""Fixtures the test modules share, the `gpu` marker's deselection, and Triton's interpreter.

Without CUDA the Triton kernels run under Triton's interpreter on CPU, which has to be on when
triton is first imported. pytest imports this file before any test module, so it imports triton
here (where installed) with TRITON_INTERPRET=1 and then restores the variable: only the tests that
ask for it (`helpers.interpreted_on_cpu`) run kernels interpreted.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    _before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401
    except ImportError:
        pass
    finally:
        if _before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = _before

from tests.helpers import SCALE, VOCAB, Pair  # noqa: E402  (after triton's import)
from tests.tiny import make_drafter, make_target  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without CUDA, tests and parameters marked `gpu` are deselected rather than skipped: a CPU
    run lists only what it runs, and its skips are the ones that say something."""
    if torch.cuda.is_available():
        return
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory):
    """The tests' engines keep their measured cost tables in a cache directory of the session's,
    not the user's (each tiny model is new, so each would leave a file behind, and a table kept
    from an earlier session would stand in for the measurement a test exercises). Converted
    models and compiled kernels are linked from the user's cache: a conversion or a compile takes
    a while and depends on nothing a test changes."""
    from drafttree import settings

    user = settings.Settings.from_env().cache.resolve()   # the links must not depend on the working directory
    root = tmp_path_factory.mktemp("drafttree-cache")
    for part in ("models", "compiled"):
        (user / part).mkdir(parents=True, exist_ok=True)
        (root / part).symlink_to(user / part, target_is_directory=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DRAFTTREE_CACHE", str(root))
        mp.setattr(settings, "_current", None)   # read again, with the variable above
        yield root


@pytest.fixture(autouse=True)
def settings_default_kept():
    """`drafttree generate` installs its process's default settings (torch.compile off); run in a
    test's process, the default is set back after the test."""
    from drafttree import settings

    current = settings._current
    yield
    settings._current = current


@pytest.fixture
def set_settings(monkeypatch):
    """set_settings(attn_kernel=False, ...): the settings in force (`drafttree.settings`, what the
    DRAFTTREE_* variables set) changed for the rest of the test."""
    from drafttree import settings

    def change(**changes) -> None:
        monkeypatch.setattr(settings, "_current", settings.current().replace(**changes))
    return change


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Every test on one thread. The models here are tiny (the real one small), where a second
    thread mostly waits; and with other processes on the cores, threads that wait for each other
    stall a test many times over (a graph-runner test on CPU: 76 s on two threads, 3.5 s on one)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """zoo(shape, vocab) -> a random target of that shape with a random drafter (block size 4),
    written once per module, its engines and plain outputs cached (`helpers.Pair`)."""
    pairs: dict[tuple[str, int], Pair] = {}

    def get(shape: str, vocab: int = VOCAB) -> Pair:
        if (shape, vocab) not in pairs:
            root = tmp_path_factory.mktemp(f"{shape}-v{vocab}")
            target = make_target(root / "target", shape, vocab=vocab, scale=SCALE)
            drafter = make_drafter(root / "drafter", target, block_size=4)
            pairs[shape, vocab] = Pair(target, drafter, vocab)
        return pairs[shape, vocab]

    return get


@pytest.fixture(scope="module")
def moe_zoo(tmp_path_factory):
    """moe_zoo(shape, vocab): as `zoo`, over the MoE/MLA shapes of tests/moe_tiny.py; the drafter
    reads the target's first and last layers."""
    from tests.moe_tiny import make_moe_target

    pairs: dict[tuple[str, int], Pair] = {}

    def get(shape: str, vocab: int = VOCAB) -> Pair:
        if (shape, vocab) not in pairs:
            root = tmp_path_factory.mktemp(f"{shape}-v{vocab}")
            target = make_moe_target(root / "target", shape, vocab=vocab, scale=SCALE)
            drafter = make_drafter(root / "drafter", target, block_size=4, target_layer_ids=[0, 2])
            pairs[shape, vocab] = Pair(target, drafter, vocab)
        return pairs[shape, vocab]

    return get


@pytest.fixture
def fake_cuda_graphs(monkeypatch):
    """Stand-ins for CUDA graphs on CPU: a 'capture' records the phase function that runs inside
    it, replay reruns it. This checks the graph runner's own logic (keys, batch and KV buckets,
    parked padding rows) without a GPU; the GPU tests in test_cuda_graphs check real capture."""
    import contextlib

    from drafttree.runner import cuda_graph
    graphs: list = []
    capturing = [False]

    class Graph:
        def __init__(self) -> None:
            self.fn = None
            graphs.append(self)

        def replay(self) -> None:
            self.fn()

    @contextlib.contextmanager
    def graph(g, pool=None, capture_error_mode="global"):
        capturing[0] = True
        yield
        capturing[0] = False

    class Stream:
        def wait_stream(self, other) -> None:
            pass

    from drafttree.runner import capture, prefill_graph
    real_capture = capture.capture_graph

    def record(fn):
        def run():
            if capturing[0]:
                graphs[-1].fn = fn
            fn()
        return run

    def recording_capture(fn, *args, **kwargs):   # the one capture routine, over the fakes below
        return real_capture(record(fn), *args, **kwargs)

    monkeypatch.setattr(cuda_graph, "capture_graph", recording_capture)
    monkeypatch.setattr(prefill_graph, "capture_graph", recording_capture)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    return graphs
