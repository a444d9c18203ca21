# SPDX-License-Identifier: Apache-2.0
"""Model output text -> OpenAI's `content`, `reasoning_content` and `tool_calls`, whole or streamed.

Pure (no I/O, no torch). The output convention is read from the bundle's chat template text
(`OutputFormat.of`): harmony markers (`<|channel|>`: gpt-oss) -> harmony channels; `<think>` ->
reasoning before `</think>`; tool calls in the Hermes convention (`<tool_call>` JSON blocks) for
every other template, those that render tools themselves (Qwen) and those with no tool convention,
where the front describes the tools in the system message itself (openai_front/tool_prompt.py).

Modules: `base` (deltas, the whole answer, held-back tails), `hermes`, `think`, `harmony` (the
parsers), `guides` (the grammars that force a tool call).
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_trt.openai_front.parsers.base import (
    Delta,
    OutputParser,
    Parsed,
    PlainContent,
    ToolCallDelta,
    collect,
    fold,
)
from dflash_trt.openai_front.parsers.harmony import HarmonyChannels
from dflash_trt.openai_front.parsers.hermes import HermesTools
from dflash_trt.openai_front.parsers.think import ThinkReasoning, opens_thinking

__all__ = ["Delta", "OutputFormat", "OutputParser", "Parsed", "ToolCallDelta", "collect", "fold"]


@dataclass(frozen=True)
class OutputFormat:
    """How a template's model writes reasoning and tool calls."""

    harmony: bool = False  # gpt-oss channels
    think: bool = False  # <think> ... </think> before the answer
    renders_tools: bool = False  # the template takes `tools` (else the front describes them)

    @classmethod
    def of(cls, template: str | None) -> OutputFormat:
        text = template or ""
        return cls(harmony="<|channel|>" in text, think="<think>" in text, renders_tools="tools" in text)

    @property
    def reasons(self) -> bool:
        """Answers carry reasoning_content."""
        return self.harmony or self.think

    def parser(self, prompt: str, *, tools: bool) -> OutputParser | None:
        """A fresh parser for one answer to `prompt` (None: the text is all content). `tools`:
        the request offered tools the model may call."""
        if self.harmony:
            return HarmonyChannels()
        inner: OutputParser = HermesTools() if tools else PlainContent()
        if self.think:
            return ThinkReasoning(inner, open_=opens_thinking(prompt))
        return inner if tools else None
