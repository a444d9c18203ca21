# SPDX-License-Identifier: Apache-2.0
"""Hermes-style tool calls (Qwen2.5, Qwen3, Hermes; and what the front asks of templates that have
no tool convention): each call is a block

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and the answer's content is the text outside the blocks. A block is sent once it closes (its name,
then its arguments as one fragment); a block that is not a JSON object with a string `name` stays
in the content as the model wrote it. Whitespace between blocks and around them is not content.
"""

from __future__ import annotations

import json

from dflash_trt.openai_front.parsers.base import Delta, ToolCallDelta, call_id, undecided

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def read_call(block: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of one block's JSON, or None when it is not a call."""
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


class HermesTools:
    def __init__(self) -> None:
        self.buf = ""
        self.inside = False  # within <tool_call> ... </tool_call>
        self.calls = 0
        self.trim = False  # drop the whitespace that follows a block

    def feed(self, text: str) -> Delta:
        self.buf += text
        out = Delta()
        while True:
            if self.inside:
                end = self.buf.find(CLOSE)
                if end < 0:
                    return out
                out.add(self._call(self.buf[:end], closed=True))
                self.buf, self.inside, self.trim = self.buf[end + len(CLOSE) :], False, True
                continue
            if self.trim:
                self.buf = self.buf.lstrip()
                if not self.buf:
                    return out
                self.trim = False
            start = self.buf.find(OPEN)
            if start < 0:
                break
            out.content += self.buf[:start].rstrip()
            self.buf, self.inside = self.buf[start + len(OPEN) :], True
        # hold back what may start a block, and trailing whitespace (it may precede one)
        head = self.buf[: len(self.buf) - undecided(self.buf, (OPEN,))]
        sent = head.rstrip()
        out.content += sent
        self.buf = self.buf[len(sent) :]
        return out

    def finish(self) -> Delta:
        if self.inside:  # the model stopped before </tool_call>: a call if the JSON is whole
            out = self._call(self.buf, closed=False)
        else:
            out = Delta(content=self.buf.rstrip() if self.calls else self.buf)
        self.buf = ""
        return out

    def _call(self, block: str, *, closed: bool) -> Delta:
        call = read_call(block)
        if call is None:
            return Delta(content=OPEN + block + (CLOSE if closed else ""))
        name, args = call
        index, self.calls = self.calls, self.calls + 1
        return Delta(tool_calls=[ToolCallDelta(index, id=call_id(), name=name), ToolCallDelta(index, args)])
