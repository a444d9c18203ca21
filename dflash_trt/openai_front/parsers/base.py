# SPDX-License-Identifier: Apache-2.0
"""What every output parser shares: the deltas it yields, the whole answer they add up to, the
held-back tail that may still become a tag, and the plain-content parser.

A parser is fed the model's text in pieces (`feed`) and told when it ends (`finish`); each call
returns a `Delta`: reasoning text, answer text and tool-call pieces, kept apart. A whole answer is
the same parser fed once (`collect`), so streamed and whole answers cannot disagree.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class ToolCallDelta:
    """One piece of a streamed tool call, as OpenAI streams them: first the call's index, id and
    name (arguments ""), then fragments of its arguments (index only)."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def body(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def add(self, other: Delta) -> Delta:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)
        return self


@dataclass
class Parsed:
    """A whole answer: reasoning, content and tool calls ({id, name, arguments})."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, str]] = field(default_factory=list)

    def message_fields(self, *, reasons: bool) -> dict[str, Any]:
        """OpenAI's message fields: content (None when only tools were called), tool_calls when
        any, and vLLM's reasoning_content when the template reasons."""
        out: dict[str, Any] = {"content": self.content}
        if self.tool_calls:
            out["content"] = self.content if self.content.strip() else None
            out["tool_calls"] = [{"id": c["id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}}
                                 for c in self.tool_calls]  # fmt: skip
        if reasons:
            out["reasoning_content"] = self.reasoning or None
        return out


class OutputParser(Protocol):
    def feed(self, text: str) -> Delta: ...

    def finish(self) -> Delta: ...


class PlainContent:
    """Text as it is: all of it is the answer."""

    def feed(self, text: str) -> Delta:
        return Delta(content=text)

    def finish(self) -> Delta:
        return Delta()


def collect(parser: OutputParser, text: str) -> Parsed:
    """The whole answer: `text` fed at once, then the end."""
    d = parser.feed(text).add(parser.finish())
    return fold([d])


def fold(deltas: list[Delta]) -> Parsed:
    """The answer a sequence of deltas adds up to."""
    out = Parsed()
    for d in deltas:
        out.reasoning += d.reasoning
        out.content += d.content
        for t in d.tool_calls:
            if t.id is not None:
                out.tool_calls.append({"id": t.id, "name": t.name or "", "arguments": t.arguments})
            else:
                out.tool_calls[t.index]["arguments"] += t.arguments
    return out


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def undecided(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`: text that a
    later piece may turn into a tag, so it is held back."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:k]):
                best = k
                break
    return best
