"""OpenAI request models, error bodies and the mapping from a request to SamplingParams."""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from drafttree.sampling import ParamError, SamplingParams, check_text

PositiveInt = Annotated[StrictInt, Field(ge=1)]
TokenId = Annotated[StrictInt, Field(ge=0)]


class OpenAIError(Exception):
    """An error answered in OpenAI's JSON shape."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.type = message, status, param, code, type
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool | None = False


# OpenAI's parameters that have no field here: each is accepted at the values that ask for
# nothing, and refused at any other, naming it. A parameter that is neither OpenAI's nor a
# field here is refused as unknown: nothing sent is ignored.
NOT_TAKEN: dict[str, tuple] = {
    "store": (None, False), "service_tier": (None, "auto", "default"), "modalities": (None, ["text"]),
    "audio": (None,), "prediction": (None,), "reasoning_effort": (None,), "web_search_options": (None,),
    "verbosity": (None,), "functions": (None, []), "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}), "tools": (None, []), "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, True, False),
}
# Tags that never change an output (OpenAI uses them for abuse monitoring, caching and stored
# completions): taken as any value.
TAGS = ("metadata", "safety_identifier", "prompt_cache_key")


def check_strings(value: Any, where: str) -> None:
    """Every string in a request is valid Unicode: a lone surrogate ("\\ud800" in JSON) is refused
    with a 400 naming where it is (`sampling.check_text`)."""
    if isinstance(value, str):
        try:
            check_text(value, where)
        except ParamError as e:
            raise OpenAIError(str(e), param=e.param) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            check_strings(k, where)
            check_strings(v, f"{where}.{k}" if where else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_strings(v, f"{where}[{i}]")


class OpenAIRequest(BaseModel):
    """Fields common to both endpoints. A field outside them is checked by `check_common`: one of
    OpenAI's that asks for nothing or a tag is taken, any other refused, naming it."""
    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None
    max_tokens: PositiveInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt | None = 1
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: StrictBool | None = False
    user: StrictStr | None = None
    # drafttree's extension: at most this many draft nodes verified per round for this request
    # (0: never speculated); see SamplingParams.max_budget
    max_budget: StrictInt | None = None
    # OpenAI's and vLLM's sampling fields not yet taken: SamplingParams refuses each unless it
    # asks for nothing (`sampling.NOT_YET`)
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    logit_bias: dict[StrictStr, StrictFloat] | None = None
    repetition_penalty: StrictFloat | None = None
    min_p: StrictFloat | None = None
    min_tokens: StrictInt | None = None
    bad_words: list[StrictStr] | None = None
    allowed_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    spaces_between_special_tokens: StrictBool | None = None
    truncate_prompt_tokens: StrictInt | None = None
    prompt_logprobs: StrictInt | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stops):
            raise OpenAIError("stop strings must not be empty", param="stop")
        return stops

    def check_common(self) -> None:
        check_strings(self.model_dump(exclude_none=True), "")
        for name, value in (self.model_extra or {}).items():
            if name in TAGS:
                continue
            if name in NOT_TAKEN:
                if any(value == v and type(value) is type(v) or value is v for v in NOT_TAKEN[name]):
                    continue
                raise OpenAIError(f"{name}={value!r} is not supported by this server (only "
                                  f"{' or '.join(map(repr, NOT_TAKEN[name]))}): it would not be applied, so the "
                                  f"request is refused rather than answered without it", param=name)
            raise OpenAIError(f"unknown parameter '{name}': neither OpenAI's nor one this server takes "
                              "(docs/vllm.md lists them)", param=name, code="unknown_parameter")
        if self.stream_options is not None and not self.stream:
            raise OpenAIError("stream_options is only allowed when stream is true", param="stream_options")

    def not_yet(self) -> dict[str, Any]:
        """The fields SamplingParams takes only at their defaults, as sent (n is one of them)."""
        names = ("n", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens",
                 "bad_words", "allowed_token_ids", "include_stop_str_in_output", "skip_special_tokens",
                 "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs", "logit_bias")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        try:
            return SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k or 0, seed=self.seed, max_tokens=max_tokens, stop=self.stop_list(),
                stop_token_ids=list(self.stop_token_ids or []), ignore_eos=bool(self.ignore_eos),
                max_budget=self.max_budget, **self.not_yet(), **self.more_params())
        except ParamError as e:
            raise OpenAIError(str(e), param=e.param) from e

    def more_params(self) -> dict[str, Any]:
        """The endpoint's own fields for SamplingParams (logprobs, best_of)."""
        return {}


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None

    def template_dict(self) -> dict[str, str]:
        if isinstance(self.content, list):
            text = "".join(p.text for p in self.content)
        else:
            text = self.content or ""
        out = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.name is not None:   # the template decides what a name means
            out["name"] = self.name
        return out


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage]
    max_completion_tokens: PositiveInt | None = None
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None

    def check(self) -> None:
        self.check_common()
        if not self.messages:
            raise OpenAIError("messages must not be empty", param="messages")
        for i, m in enumerate(self.messages):
            if m.model_extra:
                raise OpenAIError(f"messages[{i}] has fields this server does not take: {sorted(m.model_extra)}",
                                  param="messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError("top_logprobs needs logprobs: true", param="top_logprobs")

    def more_params(self) -> dict[str, Any]:
        return {"logprobs": self.top_logprobs or 0} if self.logprobs else {}

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(OpenAIRequest):
    prompt: StrictStr | list[TokenId] | list[StrictStr] | list[list[TokenId]]
    echo: StrictBool | None = False
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    def check(self) -> None:
        self.check_common()
        if self.echo:
            raise OpenAIError("echo is not supported", param="echo")
        if self.suffix:
            raise OpenAIError("suffix is not supported", param="suffix")

    def more_params(self) -> dict[str, Any]:
        return {k: v for k, v in (("logprobs", self.logprobs), ("best_of", self.best_of)) if v is not None}

    def single_prompt(self) -> str | list[int]:
        """The one prompt: a string or a list of token ids (a batch of exactly one is unwrapped)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise OpenAIError("batched prompts are not supported: send one prompt per request",
                                  param="prompt")
            p = p[0]
        if not p:
            raise OpenAIError("the prompt is empty", param="prompt")
        return p


def make_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
