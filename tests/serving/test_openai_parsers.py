# SPDX-License-Identifier: Apache-2.0
"""The OpenAI front's output parsers: model text -> content, reasoning_content and tool_calls, whole
and streamed (fed in pieces, split at every character for the longer samples), with no markup
leaking into what the client sees.

The harmony samples are written by hand in the format openai-harmony documents (its encoder needs
its vocabulary file, which cannot be downloaded here)."""

from __future__ import annotations

import json

import pytest

from dflash_trt.openai_front.parsers import Delta, OutputFormat, Parsed, collect, fold
from dflash_trt.openai_front.parsers.harmony import HarmonyChannels
from dflash_trt.openai_front.parsers.hermes import HermesTools
from dflash_trt.openai_front.parsers.think import ThinkReasoning, opens_thinking

HERMES = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
    "</tool_call>\n<tool_call>\n"
    '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>'
)
QWEN3 = "Need weather.\nCall the tool.\n</think>\n\n" + HERMES.split("\n", 1)[1]
HARMONY = (
    "<|channel|>analysis<|message|>User wants the weather; call get_weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city":"Paris"}<|call|>'
)
HARMONY_FINAL = (
    "<|channel|>analysis<|message|>Simple sum.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4<|return|>"
)
MARKUP = ("<tool_call", "</tool", "<think", "</think", "<|")


def _streamed(parser_factory, text: str, cuts: list[int]) -> tuple[Parsed, list[Delta]]:
    p = parser_factory()
    deltas, last = [], 0
    for cut in [*cuts, len(text)]:
        deltas.append(p.feed(text[last:cut]))
        last = cut
    deltas.append(p.finish())
    return fold(deltas), deltas


def _every_split(parser_factory, text: str, *, clean: bool = True) -> Parsed:
    """Whole == streamed for one cut at every position and for one character at a time; with
    `clean`, no delta carries markup."""
    whole = collect(parser_factory(), text)
    for cuts in [[i] for i in range(len(text) + 1)] + [list(range(1, len(text)))]:
        got, deltas = _streamed(parser_factory, text, cuts)
        assert _plain(got) == _plain(whole), cuts
        for d in deltas:
            assert not clean or not any(m in d.content or m in d.reasoning for m in MARKUP), (cuts, d)
    return whole


def _plain(p: Parsed) -> tuple:
    return p.reasoning, p.content, [(c["name"], c["arguments"]) for c in p.tool_calls]


def test_hermes_blocks_become_tool_calls_and_the_rest_content() -> None:
    whole = _every_split(HermesTools, HERMES)
    assert whole.content == "Let me check."
    assert [(c["name"], json.loads(c["arguments"])) for c in whole.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("get_time", {"tz": "Europe/Paris"}),
    ]
    assert len({c["id"] for c in whole.tool_calls}) == 2 and whole.tool_calls[0]["id"].startswith("call_")


def test_hermes_streams_name_first_then_arguments() -> None:
    _, deltas = _streamed(HermesTools, HERMES, list(range(1, len(HERMES))))
    pieces = [t for d in deltas for t in d.tool_calls]
    assert pieces[0].body()["function"] == {"name": "get_weather", "arguments": ""}
    assert pieces[0].body()["type"] == "function" and pieces[0].index == 0
    assert pieces[1].body() == {"index": 0, "function": {"arguments": '{"city": "Paris", "unit": "celsius"}'}}
    assert [p.index for p in pieces] == [0, 0, 1, 1]


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("no tools here, 3 < 4", "no tools here, 3 < 4", 0),
        ("<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", 0),
        ('<tool_call>\n{"arguments": {}}\n</tool_call>', '<tool_call>\n{"arguments": {}}\n</tool_call>', 0),
        ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n', "", 1),  # stopped before </tool_call>
        ('<tool_call>\n{"name": "f", "arguments": {"a"', '<tool_call>\n{"name": "f", "arguments": {"a"', 0),
        ("text then <tool_ca", "text then <tool_ca", 0),  # a prefix that never became a tag
        ("  trailing space kept  ", "  trailing space kept  ", 0),
    ],
)
def test_hermes_edge_cases(text: str, content: str, calls: int) -> None:
    whole = _every_split(HermesTools, text, clean=not any(m in content for m in MARKUP))
    assert whole.content == content and len(whole.tool_calls) == calls


def test_think_reasoning_then_tool_calls_qwen3() -> None:
    whole = _every_split(lambda: ThinkReasoning(HermesTools(), open_=True), QWEN3)
    assert whole.reasoning == "Need weather.\nCall the tool.\n"
    assert whole.content == "" and [c["name"] for c in whole.tool_calls] == ["get_weather", "get_time"]
    # the opening tag in the answer itself (the template did not open it)
    whole = _every_split(lambda: ThinkReasoning(HermesTools()), "\n<think>\nhmm</think>\n\nHello!")
    assert (whole.reasoning, whole.content) == ("\nhmm", "Hello!")
    # no reasoning at all: everything is content, whitespace included
    whole = _every_split(lambda: ThinkReasoning(HermesTools()), "  Hi <thinking> is a word", clean=False)
    assert (whole.reasoning, whole.content) == ("", "  Hi <thinking> is a word")
    # stopped while reasoning: all reasoning
    assert _plain(collect(ThinkReasoning(HermesTools(), open_=True), "still going <")) == (
        "still going <",
        "",
        [],
    )


def test_opens_thinking_reads_the_prompt() -> None:
    assert opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_thinking("<|im_start|>assistant\n")


def test_harmony_analysis_is_reasoning_and_a_function_message_is_a_call() -> None:
    whole = _every_split(HarmonyChannels, HARMONY)
    assert whole.reasoning == "User wants the weather; call get_weather." and whole.content == ""
    assert [(c["name"], c["arguments"]) for c in whole.tool_calls] == [("get_weather", '{"city":"Paris"}')]
    whole = _every_split(HarmonyChannels, HARMONY_FINAL)
    assert (whole.reasoning, whole.content, whole.tool_calls) == ("Simple sum.", "2 + 2 = 4", [])


def test_harmony_streams_arguments_as_they_come_and_reads_either_header_order() -> None:
    text = '<|channel|>analysis<|message|>x<|end|><|start|>assistant to=functions.add<|channel|>commentary json<|message|>{"a": 1, "b": 2}'
    _, deltas = _streamed(HarmonyChannels, text, list(range(1, len(text))))
    pieces = [t for d in deltas for t in d.tool_calls]
    assert pieces[0].name == "add" and pieces[0].arguments == "" and pieces[0].id
    assert (
        len(pieces) > 3 and "".join(p.arguments for p in pieces) == '{"a": 1, "b": 2}'
    )  # no <|call|>: cut at eos
    # a preamble (commentary without recipient) is content; a built-in tool's call is not for the client
    whole = collect(HarmonyChannels(), "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant"
                                       "<|channel|>analysis to=browser.search<|message|>{}<|call|>")  # fmt: skip
    assert (whole.content, whole.reasoning, whole.tool_calls) == ("Checking.", "{}", [])
    assert collect(HarmonyChannels(), "plain text, no channels").content == "plain text, no channels"


def test_output_format_is_read_from_the_template() -> None:
    smol = OutputFormat.of("{% for message in messages %}<|im_start|>{{ message['content'] }}{% endfor %}")
    assert smol == OutputFormat() and smol.parser("p", tools=False) is None
    assert isinstance(smol.parser("p", tools=True), HermesTools)
    qwen3 = OutputFormat.of("{%- if tools %}<tool_call>{% endif %}<think>\n\n</think>")
    assert qwen3.think and qwen3.renders_tools and qwen3.reasons and not qwen3.harmony
    p = qwen3.parser("<|im_start|>assistant\n<think>\n", tools=False)
    assert _plain(collect(p, "a</think>\n\n<tool_call>x")) == ("a", "<tool_call>x", [])  # no tools: content
    oss = OutputFormat.of("{{ '<|start|>assistant<|channel|>final<|message|>' }}{% if tools %}{% endif %}")
    assert oss.harmony and oss.reasons and isinstance(oss.parser("p", tools=False), HarmonyChannels)
