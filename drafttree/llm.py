"""Offline Python API in vLLM's shape: LLM(...).generate(prompts, SamplingParams(...)) for raw
completions, LLM(...).chat(messages, ...) for conversations rendered with the model's chat template.
Each returns RequestOutputs whose `.outputs` hold CompletionOutputs, as vLLM's do
(docs/vllm.md lists what still differs)."""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence as Seq
from dataclasses import asdict, dataclass, field
from typing import Any

from tqdm import tqdm

from drafttree.engine.engine import Engine, EngineConfig
from drafttree.engine.launch import follow, start_engine
from drafttree.engine.sequence import Sequence
from drafttree.engine.text import TokenTexts
from drafttree.loader.chat_template import apply_chat_template
from drafttree.sampling import SamplingParams, check_text

Prompt = str | list[int] | Mapping[str, Any]   # text, token ids, or {"prompt": ...} / {"prompt_token_ids": [...]}
# vLLM's LLM arguments that mean one of EngineConfig's (its name, and the value from theirs)
VLLM_ALIASES: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "enforce_eager": ("cuda_graphs", lambda eager: None if not eager else False),
}


@dataclass
class Logprob:
    """A token's log-probability under the target's own distribution (before any processing or
    temperature), its rank in it (1: the most likely) and its text (vLLM's Logprob)."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# per token: the token's and the `logprobs` most likely tokens', by id (vLLM's SampleLogprobs entry)
TokenLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One generated sequence of a request (vLLM's CompletionOutput). `stop_reason`: the stop
    string or stop token id that ended it (None for EOS or a length limit). With
    SamplingParams.logprobs = k: `logprobs`, per output token, the token's Logprob and those of
    the k most likely tokens (k or k + 1 entries, the token's first), and `cumulative_logprob`,
    the sum over the output's tokens; else both None."""
    index: int
    text: str | None
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's prompt and its outputs (vLLM's RequestOutput: n of them, by index). The first
    output's `token_ids`, `text` and `finish_reason` are also read here directly. With
    SamplingParams.prompt_logprobs = k: `prompt_logprobs`, per prompt token, None for the first,
    then the token's Logprob and the k most likely tokens' at its position."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: dict[str, Any] = field(default_factory=dict)
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @classmethod
    def from_seq(cls, seq: Sequence, tokenizer: Any = None) -> "RequestOutput":
        """The request of `seq` (any of its choices): every choice's output; text and the
        log-probabilities' tokens decoded with `tokenizer` (None: no text)."""
        metrics: dict[str, Any] = dict(seq.timings())
        st = seq.request_stats
        metrics.update(rounds=st.rounds, mean_accept_length=st.mean_accept_length, accept_lengths=st.accept_lengths,
                       accept_histogram=st.histogram)
        text = TokenTexts(tokenizer, missing=lambda t: None)
        outs = [CompletionOutput(c.index, c.text if tokenizer is not None else None, list(c.output_ids),
                                 c.cumulative_logprob, None if c.logprobs is None else
                                 [_entry(text, lp, ids, t) for t, (lp, ids) in zip(c.output_ids, c.logprobs)],
                                 c.finish_reason, c.stop_reason) for c in seq.choices]
        first = seq.choices[0]
        prompt_lps = None
        if first.prompt_logprobs is not None:
            prompt_lps = [None] + [_entry(text, lp, ids, t)
                                   for t, (lp, ids) in zip(first.prompt_ids[1:], first.prompt_logprobs)]
        return cls(seq.request_id, seq.prompt, list(seq.prompt_ids), outs, seq.all_finished, metrics, prompt_lps)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _entry(text: TokenTexts, lp: list[float], ids: list[int], token: int) -> TokenLogprobs:
    """One token's entry: the token first, then the most likely ones (the token among them once)."""
    out = {token: Logprob(lp[0], ids[0], text(token))}
    for rank, (t, v) in enumerate(zip(ids[1:], lp[1:]), start=1):
        if t >= 0 and t not in out:   # (-1: past a vocabulary smaller than the count asked)
            out[t] = Logprob(v, rank, text(t))
    return out


def engine_config(model: str | None, engine_args: dict[str, Any]) -> EngineConfig:
    """EngineConfig from LLM's arguments: its fields, and vLLM's names in VLLM_ALIASES. An
    argument that is neither is refused (TypeError, as for any unknown keyword), naming it."""
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    args = dict(engine_args)
    for alias, (name, convert) in VLLM_ALIASES.items():
        if alias in args:
            value = convert(args.pop(alias))
            if value is not None:
                args[name] = value
    unknown = sorted(set(args) - names)
    if unknown:
        raise TypeError(f"LLM got unknown arguments {unknown}: it takes EngineConfig's fields "
                         f"({', '.join(sorted(names - {'model'}))}) and vLLM's {', '.join(VLLM_ALIASES)}; "
                         "docs/vllm.md lists what differs from vLLM")
    return EngineConfig(model=model, **args)


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        """`model`: a Hugging Face repo id ("org/name": the local Hugging Face cache, else a download),
        a directory, a .gguf file, or None for the embedded default. `engine_args` are EngineConfig's
        fields: draft_model (resolved as model is), spec ("none" | "dflash" | "ddtree"), block_size,
        budget, budget_schedule, speculate_sampled, dtype, device, max_num_seqs, max_model_len,
        kv_cache_memory_gb, cuda_graphs (or vLLM's enforce_eager), tensor_parallel_size, ...

        With tensor_parallel_size N > 1 the target is sharded over N ranks: this process is rank 0
        and starts the others (one GPU each), or, under torchrun, every process constructs the LLM
        and the ranks other than 0 follow rank 0 inside this call, then exit when it shuts down.
        One tensor-parallel engine per process at a time: shut one down (`shutdown`, or `with
        LLM(...) as llm:`) before starting another. Use the LLM as a context manager to release
        its engine (and ranks) on exit."""
        cfg = engine_config(model, engine_args)
        if cfg.defer_graphs:
            raise ValueError("defer_graphs is the server's: an LLM has no idle time to capture graphs in, so its "
                             "constrained and processed rounds would run eagerly for good (structured_graphs=False, "
                             "processed_graphs=False skip those graphs)")
        self._engine: Engine | None = start_engine(cfg)
        self._busy = threading.Lock()   # one generate() drives the engine at a time
        if not self._engine.leader:
            raise SystemExit(follow(self._engine))

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise RuntimeError("this LLM was shut down: make a new one")
        return self._engine

    def shutdown(self) -> None:
        """Release the engine: stop its tensor-parallel ranks and leave their process group (also
        done on exit from a `with` block, when the LLM is collected, and at exit). Idempotent."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given no SamplingParams: the model's recommended
        sampling from its generation_config.json (`generation_config` "auto"), else the defaults."""
        return SamplingParams(**self.engine.sampling_defaults)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def apply_chat_template(self, messages: Seq[Mapping[str, Any]], **kwargs: Any) -> str:
        """The prompt text `chat` would generate from for one conversation."""
        return apply_chat_template(self.engine.tokenizer, messages, **kwargs)

    def chat(self, messages: Seq[Mapping[str, Any]] | Seq[Seq[Mapping[str, Any]]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool | Callable[..., tqdm] = True, *, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Generate replies to conversations, as vLLM's `LLM.chat`.

        `messages` is one conversation in the OpenAI format (a list of {"role", "content"} dicts) or a
        list of them (a batch); each is rendered with the tokenizer's chat template (or `chat_template`),
        ending with the assistant's turn opened (`add_generation_prompt`) or inside the last assistant
        message, left open for the reply to continue (`continue_final_message`; not both), and then
        generated as `generate` would. `tools` (OpenAI's function definitions) and
        `chat_template_kwargs` reach the template (e.g. {"enable_thinking": False}); the reply is
        text, its tool calls unparsed (as vLLM's `LLM.chat`).
        Returns one RequestOutput per conversation, whose `prompt` is the rendered text. Raises
        ValueError when the model has no tokenizer or no chat template."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        if not conversations:
            raise ValueError("chat() needs at least one conversation")
        for i, convo in enumerate(conversations):
            _check_strings(convo, f"messages[{i}]" if len(conversations) > 1 else "messages")
        prompts = [self.apply_chat_template(c, chat_template=chat_template,
                                            add_generation_prompt=add_generation_prompt,
                                            continue_final_message=continue_final_message, tools=tools,
                                            chat_template_kwargs=chat_template_kwargs) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def generate(self, prompts: Prompt | Iterable[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool | Callable[..., tqdm] = True) -> list[RequestOutput]:
        """Complete prompts: each a string (tokenized as is: no chat template, no special tokens added),
        a list of token ids, or vLLM's {"prompt": text} / {"prompt_token_ids": ids}. For an
        instruction-tuned model's conversational reply use `chat`, which applies the chat template
        first. One RequestOutput per prompt, in order. `use_tqdm`: a progress bar (or a tqdm-like
        class to make it).

        Every prompt and its parameters are checked before any is queued (a bad one loses nothing):
        a prompt that is empty or fills the context, or a max_tokens past the room its prompt leaves
        (None: up to the context's end) raises ValueError naming the prompt. Calls from several
        threads run one after another (each steps the engine until its own requests are done)."""
        engine = self.engine
        if isinstance(prompts, (str, Mapping)) or (isinstance(prompts, list) and prompts
                                                   and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        for i, sp in enumerate(params):
            if not isinstance(sp, SamplingParams):
                raise ValueError(f"sampling_params[{i}] is a {type(sp).__name__}, not a SamplingParams")
        requests = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            ids, text = self._prompt(p, i, sp)
            try:
                engine.check_prompt(ids)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
            room = engine.max_model_len - len(ids)
            if sp.max_tokens is not None and sp.max_tokens > room:
                raise ValueError(f"prompt {i}: the context holds {engine.max_model_len} tokens, but the prompt has "
                                 f"{len(ids)} and max_tokens asks for {sp.max_tokens} more: lower max_tokens to at "
                                 f"most {room} (or None: up to the context's end) or shorten the prompt")
            engine.check_params(ids, sp)
            requests.append((ids, text, sp))
        with self._busy:
            seqs = [engine.add_request(ids, dataclasses.replace(sp))
                    for ids, _, sp in requests]
            for seq, (_, text, _) in zip(seqs, requests):
                for c in seq.choices:
                    c.prompt = text
            make_bar = use_tqdm if callable(use_tqdm) else tqdm
            bar = make_bar(total=len(seqs), disable=not use_tqdm, desc="generate")
            done = 0
            while engine.has_unfinished():
                engine.step()
                now = sum(s.all_finished for s in seqs)
                bar.update(now - done)
                done = now
            bar.close()
        return [RequestOutput.from_seq(s, engine.tokenizer) for s in seqs]

    def _prompt(self, prompt: Prompt, i: int, sp: SamplingParams) -> tuple[list[int], str | None]:
        """(token ids, the text or None) of prompt i, checked; the ids cut as `sp` asks (`Engine.read_prompt`)."""
        if isinstance(prompt, Mapping):
            if set(prompt) == {"prompt"}:
                prompt = prompt["prompt"]
            elif set(prompt) in ({"prompt_token_ids"}, {"prompt_token_ids", "prompt"}):
                prompt = list(prompt["prompt_token_ids"])
            else:
                raise ValueError(f"prompt {i}: a dict prompt holds 'prompt' (text) or 'prompt_token_ids' and nothing "
                                 f"else (multi-modal data is not supported), got {sorted(prompt)}")
        if isinstance(prompt, str):
            check_text(prompt, f"prompt {i}")
        elif not (isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool)
                                                            for t in prompt)):
            raise ValueError(f"prompt {i} is a {type(prompt).__name__}: a prompt is a string, a list of token ids, "
                             "or a dict with 'prompt' or 'prompt_token_ids'")
        return self.engine.read_prompt(prompt, sp)


def _check_strings(value: Any, where: str) -> None:
    """Every string in a conversation is valid Unicode (`sampling.check_text`)."""
    if isinstance(value, str):
        check_text(value, where)
    elif isinstance(value, Mapping):
        for k, v in value.items():
            _check_strings(v, f"{where}.{k}")
    elif isinstance(value, (list, tuple)):
        for j, v in enumerate(value):
            _check_strings(v, f"{where}[{j}]")
