# SPDX-License-Identifier: Apache-2.0
"""`<think>` reasoning (Qwen3, DeepSeek-R1 style): `<think>reasoning</think>answer`.

Qwen3's template opens the block itself when thinking is on (the prompt ends inside `<think>`),
and closes an empty one when it is off; `opens_thinking(prompt)` tells which, and the parser starts
in the reasoning when the prompt left it open. Otherwise an answer that begins with `<think>` (after
whitespace) reasons first. What follows `</think>` (leading whitespace dropped) goes to the inner
parser: plain content, or Hermes tool calls.
"""

from __future__ import annotations

from dflash_trt.openai_front.parsers.base import Delta, OutputParser, undecided

OPEN, CLOSE = "<think>", "</think>"


def opens_thinking(prompt: str) -> bool:
    """Whether the rendered prompt ends inside a `<think>` block (the answer starts reasoning)."""
    return prompt.rfind(OPEN) > prompt.rfind(CLOSE)


class ThinkReasoning:
    def __init__(self, after: OutputParser, *, open_: bool = False) -> None:
        self.after = after
        self.mode = "reasoning" if open_ else "start"  # start -> (reasoning ->) answer
        self.buf = ""
        self.trim = False  # drop the whitespace after </think>

    def feed(self, text: str) -> Delta:
        self.buf += text
        out = Delta()
        if self.mode == "start":
            lead = self.buf.lstrip()
            if OPEN.startswith(lead):  # "", "<", "<th": not settled yet
                return out
            if lead.startswith(OPEN):
                self.buf, self.mode = lead[len(OPEN) :], "reasoning"
            else:
                self.mode = "answer"
        if self.mode == "reasoning":
            end = self.buf.find(CLOSE)
            if end < 0:
                keep = undecided(self.buf, (CLOSE,))
                out.reasoning, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
                return out
            out.reasoning = self.buf[:end]
            self.buf, self.mode, self.trim = self.buf[end + len(CLOSE) :], "answer", True
        return out.add(self._answer())

    def _answer(self) -> Delta:
        text, self.buf = self.buf, ""
        if self.trim:
            text = text.lstrip()
            self.trim = not text
        return self.after.feed(text) if text else Delta()

    def finish(self) -> Delta:
        out = Delta()
        if self.mode == "reasoning":  # the model stopped while reasoning
            out.reasoning, self.buf = self.buf, ""
        elif self.mode == "start":
            self.mode = "answer"
            out.add(self._answer())
        return out.add(self.after.finish())
