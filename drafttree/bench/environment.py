"""What a timing depends on besides its command: library versions and the settings in force."""
from __future__ import annotations

import importlib.metadata

import torch

from drafttree.settings import current


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    from drafttree.kernels import triton_jit
    s = current()
    return {"torch": torch.__version__, "triton": _version("triton"), "drafttree": _version("drafttree"),
            "cuda": torch.version.cuda,
            "kernels": {"attention": s.attn_kernel, "one_token_projections": s.gemv,
                        "few_row_projections": s.gemv and s.gemm,
                        "dependent_launch": triton_jit.pdl_on("cuda")},
            "settings": s.as_dict()}
