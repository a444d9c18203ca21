# SPDX-License-Identifier: Apache-2.0
"""The OpenAI front's request rules and response shapes, without a server (pure functions)."""

from __future__ import annotations

import pytest

from dflash_trt.openai_front import protocol as P
from dflash_trt.openai_front.upstream import UNAVAILABLE_PREFIX, model_error
from dflash_trt.triton.repository import model_py_source

SERVED = ["tiny"]


def test_completions_defaults_follow_openai() -> None:
    g = P.parse_completions({"model": "tiny", "prompt": ["hello"]}, SERVED, max_seq_len=64)
    assert (g.prompt, g.max_tokens, g.temperature, g.stream, g.include_usage) == (
        "hello",
        16,
        1.0,
        False,
        False,
    )
    assert g.stop == [] and g.stop_token_ids == [] and not g.ignore_eos


def test_extensions_and_aliases() -> None:
    g = P.parse_completions(
        {"model": "tiny", "prompt": "p", "max_tokens": 8, "stop": "\n", "stop_token_ids": [2], "ignore_eos": True,
         "min_tokens": 8, "top_k": -1, "seed": 3, "stream": True,
         "stream_options": {"include_usage": True, "continuous_usage_stats": True}, "user": "u", "n": 1},
        SERVED,
    )  # fmt: skip
    assert g.stop == ["\n"] and g.stop_token_ids == [2] and g.ignore_eos and g.min_tokens == 8
    assert g.top_k == 0 and g.seed == 3 and g.include_usage and g.continuous_usage
    c = P.parse_chat(
        {"model": "tiny", "max_completion_tokens": 5, "modalities": ["text"], "response_format": {"type": "text"},
         "messages": [{"role": "developer", "content": "be brief"},
                      {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]},
        SERVED,
    )  # fmt: skip
    assert c.max_tokens == 5
    assert c.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]
    assert (
        P.parse_chat({"model": "tiny", "messages": [{"role": "user", "content": "x"}]}, SERVED).max_tokens
        is None
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "p", "model": "other"}, "model"),
        ({"prompt": "p", "model": None}, "model"),
        ({"prompt": "p", "model": "tiny", "max_tokens": True}, "max_tokens"),
        ({"prompt": "p", "model": "tiny", "max_tokens": 65}, "max_tokens"),
        ({"prompt": "p", "model": "tiny", "temperature": 2.5}, "temperature"),
        ({"prompt": "p", "model": "tiny", "stop": ["a"] * 17}, "stop"),
        (
            {"prompt": "p", "model": "tiny", "stream": True, "stream_options": {"include_usage": 1}},
            "stream_options.include_usage",
        ),
        ({"prompt": "p", "model": "tiny", "tool_choice": "auto"}, "tool_choice"),
        ({"prompt": None, "model": "tiny"}, "prompt"),
    ],
)
def test_refusals_name_the_field(body, param) -> None:
    with pytest.raises(P.OpenAIError) as info:
        P.parse_completions(body, SERVED, max_seq_len=64)
    err = info.value.body()["error"]
    assert info.value.status == 400 and err["param"] == param and err["type"] == "invalid_request_error"
    assert "; fix: " in err["message"] and err["message"].startswith(param.split(".")[0])


def test_model_errors_are_classified() -> None:
    e = model_error("prompt has 3000 tokens, not below max_seq_len=2048; fix: shorten the prompt")
    assert (e.status, e.param) == (400, "prompt")
    e = model_error(
        "prompt of 10 tokens + max_tokens=4000 exceeds max_seq_len=2048; fix: use max_tokens <= 2038"
    )
    assert (e.status, e.param) == (400, "max_tokens")
    e = model_error("RuntimeError: CUDA error: an illegal memory access was encountered")
    assert (e.status, e.type) == (500, "server_error")
    # the model's UNAVAILABLE errors (a dead engine, draining) carry a prefix: a stream error has no code
    e = model_error("unavailable: the engine is dead (engine failure: RuntimeError: boom); retry")
    assert (e.status, e.type, e.param) == (503, "server_error", None)
    assert f'UNAVAILABLE_PREFIX = "{UNAVAILABLE_PREFIX}"' in model_py_source()  # one wire convention


def test_response_and_chunk_shapes() -> None:
    g = P.parse_chat({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": True,
                      "stream_options": {"include_usage": True}}, SERVED)  # fmt: skip
    o = P.Outcome(text="hi", prompt_tokens=5, completion_tokens=2, finish_reason="length",
                  stats={"mean_acceptance_length": 2.0000000476837, "num_rounds": 1, "total_draft_tokens": 15,
                         "total_accepted_draft_tokens": 1, "acceptance_rate": 1 / 15})  # fmt: skip
    full = P.full_response(g, "chatcmpl-1", 0, o)
    assert full["object"] == "chat.completion" and full["choices"][0]["message"]["content"] == "hi"
    assert full["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    assert full["dflash"] == {"mean_acceptance_length": 2.0, "num_rounds": 1, "accepted_draft_tokens": 1,
                              "draft_tokens": 15, "acceptance_rate": 0.066667}  # fmt: skip
    first = P.chunk(g, "chatcmpl-1", 0, text="h", role=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "h"} and first["usage"] is None
    last = P.chunk(g, "chatcmpl-1", 0, text=None, usage_obj=P.usage(o), no_choice=True)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 2
    assert P.finish_reason("None") is None and P.finish_reason("length") == "length"


def test_stop_holdback_never_streams_a_stop_string_prefix() -> None:
    h = P.StopHoldback(["END", "\n\n"])
    assert h.delta("abc E", final=False) == "abc "  # "E" may start "END"
    assert h.delta("abc EN", final=False) == ""
    assert h.delta("abc ENx", final=False) == "ENx"  # not a stop after all
    assert h.delta("abc ENx\n", final=False) == ""
    assert h.delta("abc ENx", final=True) == ""  # the engine cut the text at "\n\n"
    h = P.StopHoldback(["END"])
    assert h.delta("ab", final=False) == "ab" and h.delta("abcd", final=True) == "cd"
