"""Chat prompts: OpenAI-style messages rendered with the tokenizer's chat template.

One function for every caller (``LLM.chat``, ``drafttree generate``, the server's chat endpoint), so a
conversation gives the same prompt text whichever way it comes in.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Message = Mapping[str, Any]


def has_chat_template(tokenizer: Any) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def read_chat_template(value: str) -> str:
    """A chat template given in place of the model's (vLLM's --chat-template): a file's text, or
    the template itself; it must compile as Jinja (a ValueError naming chat_template otherwise)."""
    from pathlib import Path

    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    path = Path(value).expanduser()
    if "{" not in value and "\n" not in value:
        if not path.is_file():
            raise ValueError(f"chat_template {value!r} is neither a file nor a Jinja template")
        value = path.read_text(encoding="utf-8")
    try:
        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=["jinja2.ext.loopcontrols"]).parse(value)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat_template does not compile as Jinja: {e.message} (line {e.lineno})") from None
    return value


def _template_message(message: Message) -> dict[str, Any]:
    """The message as templates expect it: text parts joined, the "developer" role read as "system"."""
    if not isinstance(message, Mapping) or "role" not in message:
        raise ValueError(f"a chat message is a dict with 'role' and 'content', got {message!r}")
    out = dict(message)
    content = out.get("content")
    if isinstance(content, list):
        out["content"] = "".join(p.get("text", "") if isinstance(p, Mapping) else str(p) for p in content)
    elif content is None:
        out["content"] = ""
    if out["role"] == "developer":
        out["role"] = "system"
    return out


# what the renderer passes to the template itself, beside the template's own keyword arguments
RENDER_ARGUMENTS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                              "add_generation_prompt", "continue_final_message", "return_dict",
                              "return_assistant_tokens_mask", "padding", "truncation", "max_length",
                              "return_tensors", "tokenizer_kwargs"})


class TemplateOptionError(ValueError):
    """A rendering option that cannot be applied, and the option's name."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def check_template_options(messages: Sequence[Message], add_generation_prompt: bool, continue_final_message: bool,
                           template_kwargs: Mapping[str, Any] | None = None) -> None:
    """Where the prompt ends is one place: a new assistant turn, or inside the last message, which
    must be the assistant's; the template's own arguments may not set the renderer's."""
    if continue_final_message:
        if add_generation_prompt:
            raise TemplateOptionError("continue_final_message", "continue_final_message and add_generation_prompt "
                                      "cannot both be true: the prompt ends either in the last assistant message "
                                      "or in a new turn")
        last = messages[-1].get("role") if messages and isinstance(messages[-1], Mapping) else None
        if last != "assistant":
            raise TemplateOptionError("continue_final_message", "continue_final_message needs the last message to "
                                      f"be the assistant's, not the {last}'s")
    taken = sorted(RENDER_ARGUMENTS & set(template_kwargs or {}))
    if taken:
        raise TemplateOptionError("chat_template_kwargs", f"chat_template_kwargs may not set {taken}: the renderer "
                                  "sets them (pass them as its own arguments where it has them)")


def apply_chat_template(tokenizer: Any, messages: Sequence[Message], *, add_generation_prompt: bool = True,
                        continue_final_message: bool = False, chat_template: str | None = None,
                        tools: list[dict[str, Any]] | None = None,
                        chat_template_kwargs: Mapping[str, Any] | None = None, **template_kwargs: Any) -> str:
    """Render ``messages`` to prompt text (not token ids) ending where the assistant's reply starts
    (``add_generation_prompt``) or inside the last, assistant's, message (``continue_final_message``).

    ``chat_template`` replaces the tokenizer's own; ``tools`` (OpenAI's function definitions) and the
    template's own arguments reach the template: ``chat_template_kwargs`` as a request gives them
    (checked against the renderer's own), ``template_kwargs`` as a caller writes them (e.g.
    ``enable_thinking=False``). Raises ValueError without a tokenizer or template, or when the
    template rejects the messages; TemplateOptionError (a ValueError) for options that cannot be
    applied (`check_template_options`).
    """
    if tokenizer is None:
        raise ValueError("the model has no tokenizer, so no chat template: pass token ids to generate()")
    if chat_template is None and not has_chat_template(tokenizer):
        raise ValueError("the model's tokenizer has no chat template: pass chat_template=..., or prompt "
                         "text to generate(), which applies no template")
    if isinstance(messages, (str, bytes)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    check_template_options(messages, add_generation_prompt, continue_final_message, chat_template_kwargs)
    conversation = [_template_message(m) for m in messages]
    template_kwargs.update(chat_template_kwargs or {})
    if tools:
        template_kwargs["tools"] = tools
    try:
        return tokenizer.apply_chat_template(conversation, tokenize=False, chat_template=chat_template,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, **template_kwargs)
    except Exception as e:
        raise ValueError(f"the chat template rejected the messages: {e}") from e
