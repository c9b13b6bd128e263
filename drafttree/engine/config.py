"""What an engine is asked for: models, speculation, sizes and switches (all optional).

Each field's metadata says what it means (`help`), what its default means where words say it
better than the value (`default_text`: every default of None) and, where its flag is not derived
from its name and type, how the command line spells it (`engine.cli_args` makes the flags):
`flags` (the option strings; a switch's `--no-` form is added), `type` (the parser of one
command-line value), `choices`, `metavar`, and `timing_only` for fields the serving commands
leave out."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SPECS = ("none", "dflash", "ddtree")
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16")   # config.DTYPES, and auto
DRAFT_QUANTIZATIONS = ("fp8",)                                                    # models.quant.METHODS
SAMPLER_MODE_NAMES = ("greedy", "sample", "filtered")                             # sampling.SampleMode
TOOL_CALL_PARSERS = ("hermes", "kimi_k2", "llama3_json", "deepseek_v3", "deepseek_v31")   # server.tool_parsers
REASONING_PARSERS = ("deepseek_r1", "deepseek_v3", "kimi_k2", "qwen3")            # structured.reasoning
GENERATION_CONFIGS = ("auto", "vllm")                                             # vLLM's names


def parse_budget(value: int | str | None) -> int | None:
    """None for 'auto' (and None, the default), else the fixed budget (>= 1: plain decoding is
    spec 'none', and an explicit 0 must not quietly become something else)."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"budget must be 'auto' or a number of tree nodes, got {value!r}") from None
    if n < 1:
        raise ValueError(f"budget must be >= 1 or 'auto' (spec 'none' decodes plainly), got {n}")
    return n


def budget_arg(text: str) -> int | str:
    """A command line's budget: 'auto', or a fixed budget >= 1 as an int."""
    n = parse_budget(text)
    return "auto" if n is None else n


def sampler_modes_arg(text: str) -> tuple[str, ...]:
    """A command line's sampler modes, comma-separated: 'greedy,sample' -> ('greedy', 'sample')."""
    names = tuple(dict.fromkeys(n.strip().lower() for n in text.split(",") if n.strip()))
    bad = [n for n in names if n not in SAMPLER_MODE_NAMES]
    if bad or not names:
        raise ValueError(f"{bad or 'no mode given'}: choose from {', '.join(SAMPLER_MODE_NAMES)}, comma-separated")
    return names


def _opt(default: Any, help: str, default_text: str | None = None, **cli: Any) -> Any:
    meta = {"help": help, **cli}
    if default_text is not None:
        meta["default_text"] = default_text
    return field(default=default, metadata=meta)


@dataclass
class EngineConfig:
    model: str | None = _opt(None, "HF directory, .gguf file, or Hugging Face repo id (org/name: the local Hugging Face "
                                   "cache, else a download)", "the embedded SmolLM2-135M-Instruct", metavar="PATH")
    draft_model: str | None = _opt(None, "DFlash drafter directory or Hugging Face repo id",
                                   "the shipped drafter for the default model", metavar="DIR")
    spec: str | None = _opt(None, "speculative method", "ddtree when a drafter is available, else none",
                            choices=SPECS)
    block_size: int | None = _opt(None, "draft width: the tokens one drafted block holds", "the drafter's",
                                  metavar="N")
    budget: int | str | None = _opt(
        None, "auto: every round chooses the budget (DDTree nodes up to the drafter config's "
              "ddtree_default_budget, else 32; the DFlash chain; or 0, a plain decode step) that maximises "
              "expected tokens/s from the measured cost of each and the drafter's predicted acceptance; "
              "N >= 1: DDTree verifies N + 1 tokens every round (DFlash: drafts every round)",
        "auto", type=budget_arg, metavar="auto|N")
    budget_schedule: str | None = _opt(
        None, "DDTree budget by batch bucket under load, e.g. '8:16,32:4' (batch:budget; caps with budget auto); "
              "budget 0 decodes plainly from that batch size on ('16:0', DFlash too); 'none': no schedule",
        "with a fixed budget, the drafter config's ddtree_default_budget_schedule, if any", metavar="B:N,...")
    speculate_sampled: bool | None = _opt(
        None, "whether rounds with a request at temperature > 0 speculate (else they decode plainly; greedy "
              "rounds still speculate)",
        "on with budget auto, else the drafter config's ddtree_default_speculate_sampled")
    dtype: str | None = _opt(None, "weights and activations", "bf16 on CUDA, fp32 on CPU", choices=DTYPE_NAMES)
    draft_quantization: str | None = _opt(
        None, "the drafter's weights and its copy of the LM head as fp8 e4m3, a scale per row: the output is "
              "unchanged, the acceptance may move; pays for large drafters only (CUDA compute capability 8.9+, "
              "or CPU)", "none", choices=DRAFT_QUANTIZATIONS)
    device: str | None = _opt(None, "where the engine runs: cpu, cuda or cuda:N", "cuda if available")
    max_num_seqs: int = _opt(256, "requests running at once (rows of the round state); the KV page pool, not "
                                  "this, bounds how many contexts fit", metavar="N")
    max_model_len: int | None = _opt(None, "context length per request, prompt and output",
                                     "the model's, as far as the KV page pool holds it", metavar="N")
    kv_cache_memory_gb: float | None = _opt(None, "KV page pool size in GiB",
                                            "1 GiB on CPU, 60% of the free memory on CUDA", metavar="GB",
                                            flags=("--kv-cache-memory-gb", "--kv-cache-gb"))
    gpu_memory_utilization: float | None = _opt(
        None, "CUDA: the share of the device's memory the engine may use; the KV page pool gets what the weights "
              "and CUDA graphs leave of it", "none (kv_cache_memory_gb's default sizes the pool)",
        metavar="FRACTION")
    page_size: int = _opt(16, "tokens per KV page", metavar="N")   # runner.model_runner.DEFAULT_PAGE_SIZE says why
    enable_prefix_caching: bool = _opt(True, "requests share the KV pages of common prompt prefixes (off: every "
                                             "prompt is computed in full)", flags=("--prefix-caching",))
    cuda_graphs: bool | None = _opt(None, "every phase as CUDA graphs (off: every phase eagerly)", "on for CUDA")
    sampler_modes: tuple[str, ...] | None = _opt(
        None, "the sampler modes whose round graphs are captured, of greedy, sample, filtered; a batch in "
              "another mode runs eagerly, so an engine whose requests are known (one temperature) captures one",
        "all", type=sampler_modes_arg, metavar="MODE,...")
    max_graph_len: int | None = _opt(
        None, "round graphs for requests of up to N tokens (prompt and output): the KV-length buckets past the one "
              "that holds them are not captured, and a round attending over more runs eagerly (counted as a "
              "graph fallback)", "max_model_len: every bucket", metavar="N")
    structured_graphs: bool | None = _opt(
        None, "with CUDA graphs, the constrained round's graphs too (structured output and tool calls: masked "
              "picks, host-built trees), about as many again as the round graphs; off: a constrained round runs "
              "eagerly (counted as a graph fallback)", "on with CUDA graphs")
    processed_graphs: bool | None = _opt(
        None, "with CUDA graphs, the processed round's graphs too (log-probabilities, penalties, logit_bias, "
              "banned and allowed tokens, min_tokens, min_p: its decode and verify steps, greedy and filtered); "
              "off: such a round runs eagerly (counted as a graph fallback)", "on with CUDA graphs")
    defer_graphs: bool | None = _opt(
        None, "the prefill graphs and the constrained and processed rounds' graphs (prefill_graphs, "
              "structured_graphs, processed_graphs) captured after start-up, one graph at a time while the "
              "engine is idle, instead of before it serves: such a prefill or round runs eagerly until its "
              "graph is in; on one GPU and not deterministic, the start also runs the small pieces as torch "
              "ops and they compile while idle, before every round graph is captured again over them",
        "on for `drafttree serve`, off elsewhere")
    prefill_graphs: bool | None = _opt(
        None, "graphed prefill per (rows, length bucket, attention length): from position 0, or at an offset "
              "over a KV bucket (prefix-cache hits, continuing chunks), every shape the scheduler can ask for "
              "captured at start-up (off: prefill runs eagerly)", "on with CUDA graphs")
    max_prefill_tokens: int = _opt(8192, "padded tokens (chunks x the widest) in one prefill forward", metavar="N")
    prefill_chunk: int = _opt(2048, "prompt tokens per engine step, all prefill chunks together: a long prompt "
                                    "delays running streams by one chunk per step", metavar="N")
    admit_min: int = _opt(1, "while requests run, admit waiting ones only once this many rows are free (or all "
                             "waiting fit): fewer, larger prefills", metavar="N")
    overlap: bool | None = _opt(
        None, "launch each round before reading the previous one's tokens, so the host's work between rounds "
              "overlaps the device's (off: each round is read before the next launches)", "on for CUDA")
    tensor_parallel_size: int = _opt(
        1, "shard the target over N ranks, one GPU each (gloo processes on the CPU): rank 0 runs the scheduler "
           "and the others follow it; started here, or under torchrun (--nproc-per-node, --nnodes) "
           "its WORLD_SIZE processes; a size the model cannot split (heads, MLP rows, experts) is refused, naming "
           "what it must divide", flags=("--tensor-parallel-size", "-tp"), metavar="N")
    distributed_timeout_s: float = _opt(300.0, "tensor parallel: a collective waiting longer than S seconds for a "
                                               "rank fails, and the engine stops",
                                        flags=("--distributed-timeout",), metavar="S")
    deterministic: bool | None = _opt(
        None, "a token's logits the same bits whatever the phase, width and batch that computes it: speculative "
              "decoding then reproduces plain decoding bit for bit on the GPU, and a served answer can be "
              "reproduced (dense targets; costs speed, see docs/performance.md). It is this engine's "
              "settings.deterministic, in force while the engine runs (other engines in the process keep theirs)",
        "the process's settings, DRAFTTREE_DETERMINISTIC")
    generation_config: str = _opt(
        "auto", "where a request's sampling defaults come from: auto, the model's generation_config.json "
                "(its temperature, top_p, top_k, min_p, repetition_penalty, where a request leaves them out); "
                "vllm, OpenAI's (temperature 1, top_p 1)", choices=GENERATION_CONFIGS)
    tool_call_parser: str | None = _opt(
        None, "the format of tool calls in chat replies (the server parses them and forces required calls in it)",
        "the one the model's chat template writes; hermes where it names none", choices=TOOL_CALL_PARSERS)
    trust_remote_code: bool = _opt(
        False, "run the tokenizer code a model ships (Kimi K2's tokenization_kimi.py, on tiktoken); drafttree never "
               "runs a model's own modeling code")
    chat_template: str | None = _opt(
        None, "a Jinja chat template in place of the model's (a file, or the template itself): the server's chat, "
              "LLM.chat and generate render with it", "the model's own", metavar="TEMPLATE")
    reasoning_parser: str | None = _opt(
        None, "the reasoning format of a reasoning model (<think> ... </think>): chat replies carry the reasoning "
              "apart (reasoning_content) and a request's structured output or forced tool call applies from its end; "
              "generate --json reports both parts", "none: the reasoning is part of the content",
        choices=REASONING_PARSERS)
    random_weights: str | None = _opt(None, "timing only: random weights of a shape in "
                                            "drafttree.models.random_shapes (NAME@N: its first N layers)",
                                      "none", metavar="SHAPE", timing_only=True)
    random_drafter: bool = _opt(False, "timing only: an untrained drafter for the given target", timing_only=True)
