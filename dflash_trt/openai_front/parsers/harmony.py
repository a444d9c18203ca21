# SPDX-License-Identifier: Apache-2.0
"""gpt-oss's harmony format: the answer is a run of messages, each a header and a body,

    <|channel|>analysis<|message|>reasoning<|end|>
    <|start|>assistant<|channel|>final<|message|>the answer<|return|>

and a tool call is a commentary message addressed to a function, its body the JSON arguments:

    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

(the recipient `to=...` may also stand in the header before `<|channel|>`). The prompt ends with
`<|start|>assistant`, so the generated text starts with the first header. The `analysis` channel
is reasoning, `final` (and commentary without a recipient: a preamble) is content, a message to
`functions.NAME` is a tool call whose arguments stream as they are generated; a message to any
other recipient (a built-in tool) is not for the client and is kept with the reasoning.

The markers are special tokens: the engine must keep them in the text (skip_special_tokens=False).
"""

from __future__ import annotations

import re

from dflash_trt.openai_front.parsers.base import Delta, ToolCallDelta, call_id, undecided

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
FUNCTIONS = "functions."
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


class HarmonyChannels:
    def __init__(self) -> None:
        self.buf = ""
        self.in_body = False
        self.kind = "content"  # the body's destination: reasoning, content or call
        self.calls = 0

    def feed(self, text: str) -> Delta:
        self.buf += text
        out = Delta()
        while True:
            if not self.in_body:
                i = self.buf.find(MESSAGE)
                if i < 0:
                    return out
                self._header(self.buf[:i], out)
                self.buf, self.in_body = self.buf[i + len(MESSAGE) :], True
                continue
            hits = [(j, tag) for tag in ENDS if (j := self.buf.find(tag)) >= 0]
            if not hits:
                keep = undecided(self.buf, ENDS)
                self._body(self.buf[: len(self.buf) - keep], out)
                self.buf = self.buf[len(self.buf) - keep :]
                return out
            j, tag = min(hits)
            self._body(self.buf[:j], out)
            self.buf, self.in_body = self.buf[j + len(tag) :], False

    def _header(self, header: str, out: Delta) -> None:
        channel = _CHANNEL.search(header)
        to = _RECIPIENT.search(header)
        recipient = to.group(1) if to else ""
        if recipient.startswith(FUNCTIONS):
            self.kind = "call"
            out.tool_calls.append(ToolCallDelta(self.calls, id=call_id(), name=recipient[len(FUNCTIONS) :]))
            self.calls += 1
        elif recipient or (channel is not None and channel.group(1) == "analysis"):
            self.kind = "reasoning"
        else:
            self.kind = "content"

    def _body(self, text: str, out: Delta) -> None:
        if not text:
            return
        if self.kind == "call":
            out.tool_calls.append(ToolCallDelta(self.calls - 1, text))
        elif self.kind == "reasoning":
            out.reasoning += text
        else:
            out.content += text

    def finish(self) -> Delta:
        out = Delta()
        if self.in_body:  # the end marker is an end-of-sequence token the engine may have cut off
            self._body(self.buf, out)
        elif self.buf.strip() and "<|" not in self.buf:  # no harmony at all: plain text
            out.content = self.buf
        self.buf = ""
        return out
