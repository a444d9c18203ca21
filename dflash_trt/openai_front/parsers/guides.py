# SPDX-License-Identifier: Apache-2.0
"""The grammar that forces a tool call (`tool_choice: "required"` or a named function): an xgrammar
structural tag (xgrammar 0.2's `{"type": "structural_tag", "format": ...}` JSON, Triton's
`guided_decoding_guide_type` "structural_tag"; the engine compiles it with
`GrammarCompiler.compile_structural_tag`), so the answer can only be calls whose arguments
validate against the function's `parameters` schema, written the way the parsers read them.

- Hermes: one or more `<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>` blocks
  (one with a named function or `parallel_tool_calls: false`), separated by a newline; when the
  prompt left a `<think>` block open, reasoning text and `</think>\\n\\n` come first.
- harmony: an optional analysis message, then `<|channel|>commentary to=functions.NAME
  <|constrain|>json<|message|>ARGS`; the markers are matched as the special tokens they are. The
  closing `<|call|>` is left to the stop tokens: gpt-oss stops at it (its generation_config's
  eos ids), and a grammar accepts a stop token only where it is complete, so the engine's matcher
  must count `<|call|>` among its stop tokens.

Pure JSON building (xgrammar itself imports torch, so the front never imports it).
"""

from __future__ import annotations

import json
from typing import Any

GUIDE_TYPE = "structural_tag"
HARMONY_MARKERS = (
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|end|>",
    "<|call|>",
    "<|return|>",
    "<|constrain|>",
)


def tool_call_guide(functions: list[dict[str, Any]], *, harmony: bool, one: bool,
                    thinking: bool = False) -> tuple[str, str]:  # fmt: skip
    """(guide type, guide text) forcing calls to `functions` ({name, parameters} each): exactly one
    with `one`, else one or more. `thinking`: the prompt left a <think> block open (Hermes only)."""
    if harmony:
        fmt = _harmony(functions)
    else:
        fmt = _hermes(functions, one=one)
        if thinking:
            reasoning = {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": "</think>\n\n"}
            fmt = {"type": "sequence", "elements": [reasoning, fmt]}
    return GUIDE_TYPE, json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False)


def _schema(function: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments: the function's parameters schema, with at most one whitespace character in a
    row between tokens (a small model otherwise loops on whitespace until max_tokens, as the engine's
    json_schema guides compile without free whitespace for the same reason)."""
    params = function.get("parameters")
    return {
        "type": "json_schema",
        "json_schema": params if params else {"type": "object"},
        "max_whitespace_cnt": 1,
    }


def _hermes(functions: list[dict[str, Any]], *, one: bool) -> dict[str, Any]:
    tags = [{"type": "tag", "begin": '<tool_call>\n{"name": ' + json.dumps(f["name"], ensure_ascii=False)
             + ', "arguments": ', "content": _schema(f), "end": "}\n</tool_call>"} for f in functions]  # fmt: skip
    return {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
            "stop_after_first": one}  # fmt: skip


def _token(marker: str) -> dict[str, Any]:
    return {"type": "token", "token": marker}


def _harmony(functions: list[dict[str, Any]]) -> dict[str, Any]:
    analysis = {"type": "sequence", "elements": [
        _token("<|channel|>"), {"type": "const_string", "value": "analysis"}, _token("<|message|>"),
        {"type": "any_tokens", "exclude_tokens": list(HARMONY_MARKERS)}, _token("<|end|>"),
        _token("<|start|>"), {"type": "const_string", "value": "assistant"}]}  # fmt: skip
    calls = [{"type": "sequence", "elements": [
        _token("<|channel|>"), {"type": "const_string", "value": f"commentary to=functions.{f['name']} "},
        _token("<|constrain|>"), {"type": "const_string", "value": "json"}, _token("<|message|>"),
        _schema(f)]} for f in functions]  # fmt: skip
    call = calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}
    return {"type": "sequence", "elements": [{"type": "optional", "content": analysis}, call]}
