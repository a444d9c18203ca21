# SPDX-License-Identifier: Apache-2.0
"""Tools for a chat template that has no tool convention of its own (a plain ChatML template such as
SmolLM2's): the front writes the conversation in the Hermes convention the parsers read.

- the offered functions are described in the system message (after the client's own, or as a
  new first message), with the `<tool_call>` format the answer must use;
- an assistant message's earlier tool calls become `<tool_call>` blocks in its content;
- tool results become one user message of `<tool_response>` blocks (consecutive results together,
  so templates that want user and assistant turns to alternate still render).

Pure: messages in (as protocol._message makes them), messages out.
"""

from __future__ import annotations

import json
from typing import Any

INSTRUCTIONS = (
    "You may call functions to answer. Each function is described by a JSON schema inside <tools></tools>:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call one, write only a JSON object with its name and arguments inside <tool_call></tool_call> tags, "
    "one block per call:\n"
    '<tool_call>\n{{"name": "function_name", "arguments": {{"argument": "value"}}}}\n</tool_call>\n'
    "The results come back inside <tool_response></tool_response> tags. "
    "Answer in plain text when no function is needed."
)


def describe(functions: list[dict[str, Any]]) -> str:
    """The system-message text that offers `functions` ({name, description, parameters})."""
    lines = [json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in functions]
    return INSTRUCTIONS.format(tools="\n".join(lines))


def hermes_messages(messages: list[dict[str, Any]], functions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` rewritten for a template without tools: only role and text content remain."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
        elif m.get("tool_calls"):
            blocks = [_block(c["function"]) for c in m["tool_calls"]]
            out.append({"role": m["role"], "content": "\n".join(filter(None, [m["content"], *blocks]))})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    out = [{"role": m["role"], "content": m["content"]} for m in out]
    if functions:
        text = describe(functions)
        if out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _block(fn: dict[str, Any]) -> str:
    call = {"name": fn["name"], "arguments": fn["arguments"]}
    return "<tool_call>\n" + json.dumps(call, ensure_ascii=False) + "\n</tool_call>"
