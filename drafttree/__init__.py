"""drafttree: LLM inference with block-diffusion speculative decoding (DFlash, DDTree).

`LLM`, `RequestOutput`, `CompletionOutput`, `Logprob` and `SamplingParams` load on first use, so that importing a low module
(`drafttree.config`, `drafttree.phases`, the kernels) does not import the whole engine.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from drafttree.version import __version__ as __version__

if TYPE_CHECKING:
    from drafttree.llm import LLM, CompletionOutput, Logprob, RequestOutput
    from drafttree.sampling import SamplingParams

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams"]

_HOMES = {"LLM": "drafttree.llm", "CompletionOutput": "drafttree.llm", "Logprob": "drafttree.llm",
          "RequestOutput": "drafttree.llm", "SamplingParams": "drafttree.sampling"}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'drafttree' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
