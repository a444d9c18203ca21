# SPDX-License-Identifier: Apache-2.0
"""Structured-output guides in the Triton model's terms, and a compile check that needs no tokenizer.

A guide is a pair (guide type, text), the type one of TensorRT-LLM's guide types (engine/request.py
GUIDE_TYPES, sent as NVIDIA's `guided_decoding_guide_type` / `guided_decoding_guide` inputs). This
module knows what the texts are; protocol.py knows which request fields carry them.

`compile_error` compiles a guide with xgrammar's tokenizer-free constructors (a JSON schema, a
regular expression or an EBNF grammar each compile in well under a millisecond), so a bad guide is a
400 before it reaches the model; the engine compiles it again against its tokenizer. xgrammar is
imported by the first guide to compile, never at `import dflash_trt` (it imports torch; in the front,
which has torch already for its tokenizer, the import takes about 0.1 s); where it is not installed
the check is skipped and the engine alone judges the guide.
"""

from __future__ import annotations

import json
import re
from typing import Any

# xgrammar's errors start with "[hh:mm:ss] /path/file.cc:123: " (and sometimes a failed check)
_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: .*? is false: )?")
_MAX_REASON = 200  # characters of xgrammar's reason kept in a one-line error
# guide type -> the xgrammar.Grammar constructor that compiles it without a tokenizer ("json": nothing to compile)
_BUILDERS = {"json_schema": "from_json_schema", "regex": "from_regex", "ebnf_grammar": "from_ebnf",
             "structural_tag": "from_structural_tag"}  # fmt: skip


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar (xgrammar's syntax) whose language is exactly `choices`: one quoted literal per
    choice. JSON's string escapes (quote, backslash, control characters) are the EBNF literal's."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def schema_text(value: Any) -> str | None:
    """A JSON schema given as an object or as its text, as text; None unless it is a JSON object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return json.dumps(value) if isinstance(value, dict) else None


def compile_error(guide_type: str, text: str) -> str | None:
    """xgrammar's reason (one line) why the guide does not compile; None if it compiles, if its type
    has nothing to compile ("json": any JSON), or if xgrammar is not installed here."""
    name = _BUILDERS.get(guide_type)
    if name is None:
        return None
    try:
        import xgrammar
    except ImportError:
        return None
    try:
        getattr(xgrammar.Grammar, name)(text)
    except Exception as exc:  # xgrammar raises RuntimeError, ValueError or its own error types
        return reason(exc)
    return None


def reason(exc: Exception) -> str:
    """An xgrammar error as one short line, without its source location."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = _LOCATION.sub("", lines[0]) if lines else type(exc).__name__
    return text if len(text) <= _MAX_REASON else text[: _MAX_REASON - 3] + "..."
