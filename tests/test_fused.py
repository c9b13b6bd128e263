"""The compiled elementwise pieces: past Dynamo's default recompile limit they keep working and
keep matching plain PyTorch (a process with many models once failed there on the GPU)."""
from __future__ import annotations

import shutil

import pytest
import torch

from drafttree.models import layers

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="compiling on CPU needs a C compiler")


def test_many_variants_compile_and_match_eager(monkeypatch, one_thread):
    torch._dynamo.reset()
    # every tensor rank and dtype is one more compiled variant: 12 here, the old limit was 8
    cases = [(dt, rank) for dt in (torch.float32, torch.bfloat16, torch.float16) for rank in (2, 3, 4, 5)]
    g = torch.Generator().manual_seed(0)
    for dt, rank in cases:
        x = torch.randn(*(2,) * (rank - 1), 64, generator=g).to(dt)
        w = torch.randn(64, generator=g).to(dt)
        eps = 1e-5
        monkeypatch.setenv("DRAFTTREE_COMPILE", "0")
        want = layers.rms_norm(x, w, eps)
        monkeypatch.setenv("DRAFTTREE_COMPILE", "cpu")
        got = layers.rms_norm(x, w, eps)
        tol = 1e-5 if dt == torch.float32 else 2e-2
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
