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


def apply_chat_template(tokenizer: Any, messages: Sequence[Message], *, add_generation_prompt: bool = True,
                        chat_template: str | None = None, **template_kwargs: Any) -> str:
    """Render ``messages`` to prompt text (not token ids) ending where the assistant's reply starts.

    ``chat_template`` replaces the tokenizer's own; ``template_kwargs`` reach the template (e.g.
    ``enable_thinking=False``). Raises ValueError without a tokenizer or template, or when the template
    rejects the messages.
    """
    if tokenizer is None:
        raise ValueError("the model has no tokenizer, so no chat template: pass token ids to generate()")
    if chat_template is None and not has_chat_template(tokenizer):
        raise ValueError("the model's tokenizer has no chat template: pass chat_template=..., or prompt "
                         "text to generate(), which applies no template")
    if isinstance(messages, (str, bytes)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    conversation = [_template_message(m) for m in messages]
    try:
        return tokenizer.apply_chat_template(conversation, tokenize=False, chat_template=chat_template,
                                             add_generation_prompt=add_generation_prompt, **template_kwargs)
    except Exception as e:
        raise ValueError(f"the chat template rejected the messages: {e}") from e
