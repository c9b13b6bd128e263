"""OpenAI request models, error bodies and the mapping from a request to SamplingParams."""
from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from drafttree.sampling import MAX_LOGPROBS, ParamError, SamplingParams, check_text
from drafttree.structured.params import StructuredOutputs

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
    continuous_usage_stats: StrictBool | None = False   # vLLM's: every chunk carries the counts so far


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParam(BaseModel):
    """vLLM's `structured_outputs`: exactly one of these."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict[str, Any] | StrictStr | None = Field(None, alias="json")
    json_object: StrictBool | None = None
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None


# OpenAI's parameters that have no field here: each is accepted at the values that ask for
# nothing, and refused at any other, naming it. A parameter that is neither OpenAI's nor a
# field here is refused as unknown: nothing sent is ignored.
NOT_TAKEN: dict[str, tuple] = {
    "store": (None, False), "service_tier": (None, "auto", "default"), "modalities": (None, ["text"]),
    "audio": (None,), "prediction": (None,), "reasoning_effort": (None,), "web_search_options": (None,),
    "verbosity": (None,), "functions": (None, []), "function_call": (None, "none"),
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
    # the output's form: OpenAI's response_format, vLLM's structured_outputs (and its older guided_*)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParam | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None

    def structured(self) -> StructuredOutputs | None:
        """The constraint the request asks for (one form at most), or None."""
        forms: list[tuple[str, dict[str, Any]]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            forms.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise OpenAIError("response_format of type json_schema needs json_schema.schema",
                                  param="response_format")
            forms.append(("response_format", {"json": rf.json_schema.schema_, "name": rf.json_schema.name or ""}))
        if self.structured_outputs is not None:
            so = self.structured_outputs
            forms.append(("structured_outputs", {k: v for k, v in (("json", so.json_), ("json_object", so.json_object),
                                                                  ("regex", so.regex), ("choice", so.choice),
                                                                  ("grammar", so.grammar)) if v is not None}))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                forms.append((name, {kind: getattr(self, name)}))
        if not forms:
            return None
        if len(forms) > 1:
            raise OpenAIError(f"give one form of structured output, not {' and '.join(n for n, _ in forms)}",
                              param=forms[1][0])
        name, kw = forms[0]
        try:
            return StructuredOutputs(**kw)
        except ValueError as e:
            raise OpenAIError(str(e), param=name) from e

    # OpenAI's and vLLM's sampling fields, each as SamplingParams takes it (n choices, penalties,
    # logit_bias with OpenAI's token-id strings for keys, banned and allowed tokens, min_tokens,
    # min_p, vLLM's prompt_logprobs); those it does not take yet it refuses unless they ask
    # for nothing (`sampling.NOT_YET`)
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

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

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
        if self.stream_options is not None and self.stream_options.continuous_usage_stats and \
                not self.stream_options.include_usage:
            raise OpenAIError("stream_options.continuous_usage_stats needs include_usage: true (the counts so far "
                              "in every chunk are the usage's)", param="stream_options")

    def vllm_fields(self) -> dict[str, Any]:
        """The sampling fields SamplingParams takes by the same name, as sent (logit_bias's keys
        read as token ids)."""
        names = ("n", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens",
                 "bad_words", "allowed_token_ids", "include_stop_str_in_output", "skip_special_tokens",
                 "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs")
        out = {k: getattr(self, k) for k in names if getattr(self, k) is not None}
        if self.logit_bias is not None:
            out["logit_bias"] = token_bias(self.logit_bias)
        return out

    def sampling_params(self, max_tokens: int, structured: StructuredOutputs | None = None,
                        defaults: dict[str, Any] | None = None) -> SamplingParams:
        """`defaults`: the model's sampling (`Engine.sampling_defaults`), for the fields the
        request leaves out."""
        if self.stream and self.prompt_logprobs is not None:
            raise OpenAIError("prompt_logprobs is not available with stream: true (as vLLM's server); ask "
                              "without streaming", param="prompt_logprobs")
        given = {k: getattr(self, k) for k in ("temperature", "top_p", "top_k") if getattr(self, k) is not None}
        try:
            return SamplingParams(
                seed=self.seed, max_tokens=max_tokens, stop=self.stop_list(),
                stop_token_ids=list(self.stop_token_ids or []), ignore_eos=bool(self.ignore_eos),
                max_budget=self.max_budget, structured_outputs=structured,
                **{**(defaults or {}), **given, **self.vllm_fields(), **self.more_params()})
        except ParamError as e:
            raise OpenAIError(str(e), param=e.param) from e

    def more_params(self) -> dict[str, Any]:
        """The endpoint's own fields for SamplingParams (logprobs, best_of)."""
        return {}


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class FunctionCall(BaseModel):
    name: StrictStr
    arguments: StrictStr | dict[str, Any] = "{}"


class MessageToolCall(BaseModel):
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


# fields of a chat response's message that come back empty in the next request's history
ECHOED_EMPTY = frozenset({"refusal", "annotations", "audio", "function_call"})


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: StrictStr | None = None
    # an assistant turn's reasoning, as a reply gave it (both names, as the server sends them);
    # chat templates that keep reasoning in the history read `reasoning_content`
    reasoning_content: StrictStr | None = None
    reasoning: StrictStr | None = None

    def check_reasoning(self, where: str) -> None:
        given = {k: v for k, v in (("reasoning_content", self.reasoning_content), ("reasoning", self.reasoning)) if v}
        if given and self.role != "assistant":
            raise OpenAIError(f"{where}: {min(given)} belongs to assistant messages, not {self.role}", param="messages")
        if len(set(given.values())) > 1:
            raise OpenAIError(f"{where}: reasoning_content and reasoning differ; give one", param="messages")

    def template_dict(self) -> dict[str, Any]:
        if isinstance(self.content, list):
            text = "".join(p.text for p in self.content)
        else:
            text = self.content or ""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning_content or self.reasoning:
            out["reasoning_content"] = self.reasoning_content or self.reasoning
        if self.tool_calls:
            # templates read the arguments as a mapping (OpenAI sends JSON text)
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                 for c in self.tool_calls]
        return out


def _arguments(args: str | dict[str, Any]) -> Any:
    if isinstance(args, dict):
        return args
    try:
        return json.loads(args)
    except ValueError:
        return args


class FunctionDef(BaseModel):
    name: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolDef(BaseModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    name: StrictStr


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class TemplateOptions(BaseModel):
    """vLLM's chat template options: where the rendered prompt ends (a new assistant turn, or the
    last assistant message left open to be continued) and the template's own keyword arguments
    (`{"enable_thinking": false}` for Qwen3's, `{"thinking": false}` for Kimi K2's); what cannot
    be applied the rendering refuses (`loader.chat_template.check_template_options`)."""
    messages: list[ChatMessage] | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def check_template(self) -> None:
        if self.messages is None:
            for name in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs"):
                if name in self.model_fields_set:
                    raise OpenAIError(f"{name} goes with messages, not with prompt", param=name)
            return
        if not self.messages:
            raise OpenAIError("messages must not be empty", param="messages")
        for i, m in enumerate(self.messages):
            m.check_reasoning(f"messages[{i}]")

    def template_options(self) -> dict[str, Any]:
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message, "chat_template_kwargs": self.chat_template_kwargs}


class ChatCompletionRequest(TemplateOptions, OpenAIRequest):
    messages: list[ChatMessage]
    max_completion_tokens: PositiveInt | None = None
    logprobs: StrictBool | None = False
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    # vLLM's: with a reasoning parser, false leaves the reasoning out of the reply
    include_reasoning: StrictBool = True

    def check(self) -> None:
        self.check_common()
        self.check_template()
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            raise OpenAIError("tool_choice needs tools", param="tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in self.tools or []}:
            raise OpenAIError(f"tool_choice names the function {choice.function.name!r}, which is not among the "
                              f"tools", param="tool_choice")
        for i, m in enumerate(self.messages):
            # an assistant message sent back as the response gave it (`message.model_dump()`)
            # carries the response's own fields, empty
            extra = sorted(k for k, v in (m.model_extra or {}).items() if k not in ECHOED_EMPTY or v not in (None, [], ""))
            if extra:
                raise OpenAIError(f"messages[{i}] has fields this server does not take: {extra}", param="messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError("top_logprobs needs logprobs: true", param="top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise OpenAIError(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                              param="top_logprobs")

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
        if self.suffix:
            raise OpenAIError("suffix is not supported", param="suffix")

    def more_params(self) -> dict[str, Any]:
        """logprobs, best_of; with echo and logprobs, the prompt's log-probabilities too (the
        echoed prompt's tokens carry theirs, as lm-eval's loglikelihood reads them)."""
        out = {k: v for k, v in (("logprobs", self.logprobs), ("best_of", self.best_of)) if v is not None}
        if self.echo and self.logprobs is not None:
            out["prompt_logprobs"] = max(self.logprobs, self.prompt_logprobs or 0)
        return out

    def prompt_list(self) -> list[str | list[int]]:
        """The prompts: one (a string or a list of token ids) or a batch of them, each answered as
        its own request."""
        p = self.prompt
        prompts = list(p) if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
        for i, x in enumerate(prompts):
            if not x:
                raise OpenAIError("the prompt is empty" if len(prompts) == 1 else f"prompt[{i}] is empty",
                                  param="prompt")
        return prompts


def token_bias(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias (token ids as decimal strings) as SamplingParams takes it; a key that is
    not a token id is refused naming logit_bias (the values' range SamplingParams checks)."""
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()):
            raise OpenAIError(f"logit_bias keys must be token ids (decimal integers >= 0), got {key!r}",
                              param="logit_bias")
        out[int(key)] = value
    return out


def make_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class TokenizeRequest(TemplateOptions):
    """vLLM's `/tokenize`: a prompt as `/v1/completions` takes its text, or messages (and tools)
    as `/v1/chat/completions` renders them, to the token ids the engine would be given."""
    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    tools: list[ToolDef] | None = None
    add_special_tokens: StrictBool = False
    return_token_strs: StrictBool = False
    # a chat request's tools are shown to the model as under tool_choice "auto"
    tool_choice: ClassVar[None] = None
    parallel_tool_calls: ClassVar[None] = None

    def check(self) -> None:
        check_strings(self.model_dump(exclude_none=True), "")
        if self.model_extra:
            name = min(self.model_extra)
            raise OpenAIError(f"unknown parameter '{name}' for /tokenize (it takes model, prompt or messages, tools, "
                              "add_generation_prompt, continue_final_message, chat_template_kwargs, "
                              "add_special_tokens, return_token_strs)", param=name, code="unknown_parameter")
        if (self.prompt is None) == (self.messages is None):
            raise OpenAIError("/tokenize takes exactly one of prompt and messages", param="prompt")
        if self.messages is None and "tools" in self.model_fields_set:
            raise OpenAIError("tools goes with messages, not with prompt", param="tools")
        self.check_template()


class DetokenizeRequest(BaseModel):
    """vLLM's `/detokenize`: token ids to their text."""
    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    tokens: list[TokenId]
