"""Deterministic mode's kernels compiled for a Hopper GPU (sm_90) without one: Triton's compiler
runs on the CPU, so what the interpreter accepts but the GPU compiler would reject (loop-carried
types, launch options, layouts) fails here, before any GPU run. In a process of its own: this
one's Triton runs interpreted (conftest)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import compile_hopper
from tests.helpers import requires_triton


@requires_triton
def test_deterministic_kernels_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "tests.compile_hopper"], cwd=Path(__file__).parent.parent, env=env,
                         capture_output=True, text=True, timeout=600)
    if run.returncode == 3:
        pytest.skip(run.stdout.strip())
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("ok ") == len(list(compile_hopper.variants()))
