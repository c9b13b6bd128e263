"""What a timing depends on besides its command: library versions and the kernel switches."""
from __future__ import annotations

import importlib.metadata
import os

import torch


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    from drafttree.kernels import triton_jit
    from drafttree.kernels import attn_kernel, gemm_kernel, gemv_kernel
    return {"torch": torch.__version__, "triton": _version("triton"), "drafttree": _version("drafttree"),
            "cuda": torch.version.cuda,
            "kernels": {"attention": attn_kernel.ENABLED, "one_token_projections": gemv_kernel.ENABLED,
                        "few_row_projections": gemv_kernel.ENABLED and gemm_kernel.ENABLED,
                        "dependent_launch": triton_jit.pdl_options("cuda")["PDL"]},
            "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("DRAFTTREE_")}}
