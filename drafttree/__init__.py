"""drafttree: LLM inference with block-diffusion speculative decoding (DFlash, DDTree)."""
from drafttree.llm import LLM, RequestOutput
from drafttree.sampling import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
