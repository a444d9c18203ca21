# SPDX-License-Identifier: Apache-2.0
"""The grammars that force a tool call compile with xgrammar 0.2 (as the engine compiles them) and
accept, token by token, exactly the calls the parsers read: a valid call passes and ends, a call
whose arguments break the function's schema, plain text or no call at all are refused.

Hermes guides are checked with SmolLM2-135M's real tokenizer. The harmony guide needs gpt-oss's
special tokens, so it is checked with a small hand-made vocabulary that has them (openai-harmony's
tokenizer cannot be loaded offline here)."""

from __future__ import annotations

import json
import re
import string

import pytest

from dflash_trt.openai_front.parsers import OutputFormat, collect
from dflash_trt.openai_front.parsers.guides import HARMONY_MARKERS, tool_call_guide

xgr = pytest.importorskip("xgrammar", reason="the engine's grammar backend")

WEATHER = {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city"]}}  # fmt: skip
NOARGS = {"name": "ping"}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
PING = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'


@pytest.fixture(scope="module")
def smol():
    from transformers import AutoTokenizer

    from dflash_trt.smollm2 import ensure_smollm2

    tok = AutoTokenizer.from_pretrained(ensure_smollm2().target)
    return tok, xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok))


def _accepts(compiled, ids: list[int], stop: int) -> bool:
    m = xgr.GrammarMatcher(compiled)
    return all(m.accept_token(i) for i in ids) and m.accept_token(stop) and m.is_terminated()


@pytest.mark.parametrize("thinking", [False, True])
def test_hermes_guide_takes_valid_calls_only(smol, thinking: bool) -> None:
    tok, compiler = smol
    kind, text = tool_call_guide([WEATHER, NOARGS], harmony=False, one=False, thinking=thinking)
    assert kind == "structural_tag"
    compiled = compiler.compile_structural_tag(text)
    pre = "The user wants weather.\n</think>\n\n" if thinking else ""

    def ok(s: str) -> bool:
        return _accepts(compiled, tok.encode(pre + s, add_special_tokens=False), tok.eos_token_id)

    assert ok(CALL) and ok(CALL + "\n" + PING)
    assert not ok(CALL.replace('"city"', '"town"'))  # a required property missing, an unknown one
    assert not ok(CALL.replace('"c"}', '"kelvin"}'))  # outside the enum
    assert not ok('<tool_call>\n{"name": "other", "arguments": {}}\n</tool_call>')  # not offered
    assert not ok("Sure, here is the weather.") and not ok("")
    # what the guide lets through, the parser reads as the call
    fmt = OutputFormat.of("<tool_call><think>" if thinking else "")
    parsed = collect(fmt.parser("<think>\n" if thinking else "", tools=True), pre + CALL + "\n" + PING)
    assert [(c["name"], json.loads(c["arguments"])) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}), ("ping", {})]  # fmt: skip


def test_hermes_guide_for_one_call_stops_after_it(smol) -> None:
    tok, compiler = smol
    compiled = compiler.compile_structural_tag(tool_call_guide([WEATHER], harmony=False, one=True)[1])
    assert _accepts(compiled, tok.encode(CALL, add_special_tokens=False), tok.eos_token_id)
    assert not _accepts(compiled, tok.encode(CALL + "\n" + CALL, add_special_tokens=False), tok.eos_token_id)
    assert not _accepts(compiled, tok.encode(PING, add_special_tokens=False), tok.eos_token_id)


def test_harmony_guide_takes_a_function_message_after_optional_analysis() -> None:
    vocab = [*HARMONY_MARKERS, "<|endoftext|>", *string.printable]
    call_id = vocab.index("<|call|>")
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo(vocab, stop_token_ids=[call_id])).compile_structural_tag(
        tool_call_guide([WEATHER, NOARGS], harmony=True, one=True)[1])  # fmt: skip

    def ids(s: str) -> list[int]:
        out: list[int] = []
        for part in re.split(r"(<\|[a-z]+\|>)", s):
            out += [vocab.index(part)] if part in HARMONY_MARKERS else [vocab.index(c) for c in part]
        return out

    call = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
    assert _accepts(compiled, ids(call), call_id)
    assert _accepts(
        compiled,
        ids("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant" + call),
        call_id,
    )
    assert _accepts(
        compiled, ids("<|channel|>commentary to=functions.ping <|constrain|>json<|message|>{}"), call_id
    )
    assert not _accepts(compiled, ids(call.replace("city", "town")), call_id)
    assert not _accepts(compiled, ids("<|channel|>final<|message|>It is sunny."), call_id)
    parsed = collect(OutputFormat(harmony=True).parser("", tools=True), call + "<|call|>")
    assert [(c["name"], c["arguments"]) for c in parsed.tool_calls] == [("get_weather", '{"city": "Paris"}')]
