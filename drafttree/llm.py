"""Offline Python API in the style of vLLM: LLM(...).generate(prompts, SamplingParams(...))."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from tqdm import tqdm

from drafttree.engine.engine import Engine, EngineConfig
from drafttree.engine.sequence import Sequence
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
        kv_cache_memory_gb, cuda_graphs, max_prefill_tokens, prefill_chunk, random_weights, ..."""
        self.engine = Engine(EngineConfig(model=model, **engine_args))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        tok = self.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError("this model has no chat template")
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def generate(self, prompts: str | list[int] | Iterable[str | list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
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
