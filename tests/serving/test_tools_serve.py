# SPDX-License-Identifier: Apache-2.0
"""Tool calling end to end: the real SmolLM2-135M pair built and served (`dflash-trt serve
--openai-port`), driven by the official `openai` client.

SmolLM2's template has no tool convention, so the front describes the tools in the system message
and reads Hermes `<tool_call>` blocks. A 135M model does not call tools reliably by itself: the
tests marked `guided` force the call with `tool_choice` (`required` or a named function), which the
front sends as a structural-tag guide, and so they need the engine's guided decoding (the Triton
model's `guided_decoding_guide_type` / `guided_decoding_guide` inputs compiled with xgrammar). The
follow-up turn (the tool's result, then a plain answer) needs no grammar."""

from __future__ import annotations

import json
import signal

import openai
import pytest

from tests.serving.conftest import build_bundle, fold_chat_stream, launch_serve

pytestmark = [pytest.mark.triton_server, pytest.mark.slow]

MODEL = "smollm2-135m"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "description": "The local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    bundle = build_bundle(tmp_path_factory.mktemp("bundles") / "smollm2", "--target", "smollm2-135m",
                          "--drafter", "smollm2-135m-dflash")  # fmt: skip
    proc, ports = launch_serve(bundle, openai=True, timeout=240)
    with openai.OpenAI(base_url=f"http://127.0.0.1:{ports['openai']}/v1", api_key="none", max_retries=0,
                       timeout=120) as c:  # fmt: skip
        yield c
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err


def _streamed_calls(chunks) -> tuple[list[dict], str | None, str]:
    content, calls, finish = fold_chat_stream(chunks)
    return calls, finish, content


@pytest.mark.guided
def test_required_tool_choice_gives_a_call_that_fits_the_schema(client) -> None:
    """One call (parallel_tool_calls false), whole and streamed alike."""
    kw = {"model": MODEL, "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required", "temperature": 0,
          "max_tokens": 96, "parallel_tool_calls": False}  # fmt: skip
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
    _check_calls(choice.message.tool_calls)
    assert not choice.message.content
    calls, finish, content = _streamed_calls(client.chat.completions.create(**kw, stream=True))
    assert finish == "tool_calls" and not content
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (t.function.name, json.loads(t.function.arguments)) for t in choice.message.tool_calls
    ]


@pytest.mark.guided
def test_required_parallel_calls_each_fit_the_schema(client) -> None:
    """Parallel calls allowed: however many the model makes (a 135M model repeats its call), every complete
    call's arguments validate."""
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                       temperature=0, max_tokens=160)  # fmt: skip
    choice = r.choices[0]
    assert choice.message.tool_calls and choice.finish_reason in ("tool_calls", "length"), choice
    _check_calls(choice.message.tool_calls)


def _check_calls(calls) -> None:
    for call in calls:
        args = json.loads(call.function.arguments)
        assert call.function.name in ("get_weather", "get_time") and isinstance(args["city"], str)
        assert set(args) <= {"city", "unit"} and call.id.startswith("call_")


@pytest.mark.guided
def test_a_named_function_is_called_once(client) -> None:
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=96,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})  # fmt: skip
    calls = r.choices[0].message.tool_calls
    assert (
        r.choices[0].finish_reason == "tool_calls"
        and len(calls) == 1
        and calls[0].function.name == "get_time"
    )
    assert isinstance(json.loads(calls[0].function.arguments)["city"], str)


def test_a_tool_result_is_answered_in_plain_text(client) -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}  # fmt: skip
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temperature_c": 18, "sky": "sunny"})}]  # fmt: skip
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                       temperature=0, max_tokens=48)  # fmt: skip
    msg = r.choices[0].message
    assert r.choices[0].finish_reason in ("stop", "length") and msg.content and not msg.tool_calls
    assert "<|im_" not in msg.content  # (what a 135M model writes after a result is its own choice)
    streamed = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                              temperature=0, max_tokens=48, stream=True)  # fmt: skip
    assert _streamed_calls(streamed)[2] == msg.content
