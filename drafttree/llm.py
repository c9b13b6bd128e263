"""Offline Python API in the style of vLLM: LLM(...).generate(prompts, SamplingParams(...)) for raw
completions, LLM(...).chat(messages, ...) for conversations rendered with the model's chat template."""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence as Seq
from dataclasses import asdict, dataclass, field
from typing import Any

from tqdm import tqdm

from drafttree.engine.engine import EngineConfig
from drafttree.engine.launch import follow, start_engine
from drafttree.engine.sequence import Sequence
from drafttree.loader.chat_template import apply_chat_template
from drafttree.sampling import SamplingParams


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    metrics: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_seq(cls, seq: Sequence, has_tokenizer: bool) -> "RequestOutput":
        metrics: dict[str, Any] = dict(seq.timings())
        metrics.update(rounds=seq.stats.rounds, mean_accept_length=seq.stats.mean_accept_length,
                       accept_lengths=list(seq.stats.accept_lengths),
                       accept_histogram=seq.stats.histogram)
        return cls(seq.request_id, seq.prompt, list(seq.prompt_ids), list(seq.output_ids),
                   seq.text if has_tokenizer else None, seq.finish_reason, metrics)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        """`engine_args` are EngineConfig's fields: draft_model, spec ("none" | "dflash" | "ddtree"),
        block_size, budget, budget_schedule, speculate_sampled, dtype, device, max_num_seqs, max_model_len,
        kv_cache_memory_gb, cuda_graphs, max_prefill_tokens, prefill_chunk, tensor_parallel_size,
        random_weights, ...

        With tensor_parallel_size N > 1 the target is sharded over N ranks: this process is rank 0
        and starts the others (one GPU each), or, under torchrun, every process constructs the LLM
        and the ranks other than 0 follow rank 0 inside this call, then exit when it shuts down."""
        self.engine = start_engine(EngineConfig(model=model, **engine_args))
        if not self.engine.leader:
            raise SystemExit(follow(self.engine))

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks (also done when the LLM is collected and at exit)."""
        self.engine.shutdown()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def apply_chat_template(self, messages: Seq[Mapping[str, Any]], **kwargs: Any) -> str:
        """The prompt text `chat` would generate from for one conversation."""
        return apply_chat_template(self.engine.tokenizer, messages, **kwargs)

    def chat(self, messages: Seq[Mapping[str, Any]] | Seq[Seq[Mapping[str, Any]]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False, *, chat_template: str | None = None, add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Generate replies to conversations, as vLLM's `LLM.chat`.

        `messages` is one conversation in the OpenAI format (a list of {"role", "content"} dicts) or a
        list of them (a batch); each is rendered with the tokenizer's chat template (or `chat_template`),
        ending with the assistant's turn opened (`add_generation_prompt`), and then generated as
        `generate` would. `chat_template_kwargs` reach the template (e.g. {"enable_thinking": False}).
        Returns one RequestOutput per conversation, whose `prompt` is the rendered text. Raises
        ValueError when the model has no tokenizer or no chat template."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        if not conversations:
            raise ValueError("chat() needs at least one conversation")
        prompts = [self.apply_chat_template(c, chat_template=chat_template,
                                            add_generation_prompt=add_generation_prompt,
                                            **(chat_template_kwargs or {})) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def generate(self, prompts: str | list[int] | Iterable[str | list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Complete prompts: each a string (tokenized as is: no chat template, no special tokens added)
        or a list of token ids. For an instruction-tuned model's conversational reply use `chat`, which
        applies the chat template first. One RequestOutput per prompt, in order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        # Validate every prompt before queuing any: a bad one loses nothing.
        for p in prompts:
            self.engine.check_prompt(self.engine.encode(p)[0])
        seqs = [self.engine.add_request(p, SamplingParams(**asdict(sp))) for p, sp in zip(prompts, params)]
        bar = tqdm(total=len(seqs), disable=not use_tqdm, desc="generate")
        done = 0
        while self.engine.has_unfinished():
            self.engine.step()
            now = sum(s.finished for s in seqs)
            bar.update(now - done)
            done = now
        bar.close()
        has_tok = self.engine.tokenizer is not None
        return [RequestOutput.from_seq(s, has_tok) for s in seqs]
