"""A reasoning model's chat reply in two parts, `reasoning_content` and `content`, whole and
streamed. The reasoning is sent under both names: `reasoning_content` (DeepSeek's, Moonshot's and
vLLM's older name, what most clients read) and `reasoning` (vLLM's newer one)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from drafttree.structured.reasoning import PartsReader, ReplyParts

REASONING_FIELDS = ("reasoning_content", "reasoning")


def reasoning_fields(text: str) -> dict[str, str]:
    return {k: text for k in REASONING_FIELDS}


@dataclass
class ReasoningStream:
    """A streamed choice's parts as they grow, and what it has sent of its reasoning."""
    reader: PartsReader
    sent: int = 0

    def deltas(self, parts: ReplyParts, final: bool, hold: int) -> list[dict[str, Any]]:
        """The deltas the reasoning so far adds. While it grows, its last `hold` characters (what
        could still become a stop string), an unfinished character and trailing whitespace (cut
        at its end) wait."""
        text = parts.reasoning
        if parts.ended or final:
            end = len(text)
        else:
            end = len(text) - hold
            while end > self.sent and (text[end - 1] == "\ufffd" or text[end - 1].isspace()):
                end -= 1
        if end <= self.sent:
            return []
        piece, self.sent = text[self.sent:end], end
        return [reasoning_fields(piece)]
