"""What an engine is asked for: models, speculation, sizes and switches (all optional)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    model: str | None = None            # HF directory, .gguf file, or None for the default
    draft_model: str | None = None
    spec: str | None = None             # none | dflash | ddtree; default ddtree with a drafter
    block_size: int | None = None       # default: the drafter's
    budget: int | str | None = None     # "auto" (None: the default): each round chooses its budget up to
                                        # the drafter's ddtree_default_budget (else 32) by measured cost
                                        # and predicted acceptance, 0 (decode) included; N: DDTree's tree
                                        # at N nodes every round (DFlash: any N >= 1, the chain every round)
    budget_schedule: str | None = None  # DDTree budget by batch bucket, e.g. "8:16,32:4" (caps when
                                        # auto); default with a fixed budget: the drafter config's, if
                                        # any ("none": no schedule)
    speculate_sampled: bool | None = None  # rounds with a row at T > 0 speculate too; default: on when
                                        # auto, else the drafter config's ddtree_default_speculate_sampled
    dtype: str | None = None            # auto: bf16 on CUDA, fp32 on CPU
    draft_quantization: str | None = None   # fp8: the drafter's weights (and its LM head copy) as
                                        # e4m3 with a scale per row; the output is unchanged
    device: str | None = None           # auto: cuda if available
    max_num_seqs: int = 256             # requests running at once (rows of the round state); the KV
                                        # pool, not this, bounds how many contexts fit
    max_model_len: int | None = None
    kv_cache_memory_gb: float | None = None   # the KV page pool; default: 1 GiB on CPU, 60% of free on CUDA
    gpu_memory_utilization: float | None = None  # CUDA: the share of the device's memory the engine
                                        # may use; the pool gets what weights and graphs leave of it
    page_size: int = 16                 # tokens per KV page (runner.model_runner.DEFAULT_PAGE_SIZE says why)
    enable_prefix_caching: bool = True  # share the KV pages of common prompt prefixes
    cuda_graphs: bool | None = None     # default: on for CUDA
    sampler_modes: tuple[str, ...] | None = None   # round graphs per sampler mode, of greedy, sample,
                                        # filtered (None: all); a batch in another mode runs eagerly, so an
                                        # engine whose requests are known (one temperature) captures one
    prefill_graphs: bool | None = None  # graphed prefill per (rows, length bucket, attention length:
                                        # from position 0, or at an offset over a KV bucket), every shape
                                        # the scheduler can ask for captured at start-up
                                        # (runner.prefill_plan); default: on with CUDA graphs
    max_prefill_tokens: int = 8192      # padded tokens (chunks x widest) in one prefill forward
    prefill_chunk: int = 2048           # prompt tokens per engine step, all prefill chunks together:
                                        # a long prompt delays running streams by one chunk per step
    admit_min: int = 1                  # while requests run, admit waiting ones only once this many
                                        # rows are free (or all waiting fit): fewer, larger prefills
    overlap: bool | None = None         # launch each round before reading the previous one's tokens
                                        # (hides the host's work between rounds); default: on for CUDA
    tensor_parallel_size: int = 1       # ranks (one GPU each) the target is sharded over; rank 0 runs the
                                        # scheduler and the others follow (`engine.launch`); under torchrun,
                                        # its WORLD_SIZE
    distributed_timeout_s: float = 300.0   # a collective waiting longer for a rank fails, and the engine stops
    deterministic: bool | None = None   # a token's logits the same bits in every phase and batch, so
                                        # speculation reproduces plain decoding bit for bit on the GPU
                                        # (settings.deterministic, which the engine sets for the whole
                                        # process; default: as the settings are, DRAFTTREE_DETERMINISTIC)
    random_weights: str | None = None   # timing-only: a shape from drafttree.models.random_shapes
    random_drafter: bool = False        # timing-only: an untrained drafter for the given target
