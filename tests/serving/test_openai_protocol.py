# SPDX-License-Identifier: Apache-2.0
"""The OpenAI front's request rules and response shapes, without a server (pure functions)."""

from __future__ import annotations

import pytest

from dflash_trt.openai_front import protocol as P
from dflash_trt.openai_front.upstream import model_error

SERVED = ["tiny"]


def test_completions_defaults_follow_openai() -> None:
    g = P.parse_completions({"model": "tiny", "prompt": ["hello"]}, SERVED)
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
        ({"prompt": "p", "model": "tiny", "max_tokens": 2**31}, "max_tokens"),  # beyond the INT32 input
        ({"prompt": "p", "model": "tiny", "temperature": "hot"}, "temperature"),
        ({"prompt": "p", "model": "tiny", "seed": -1}, "seed"),  # the UINT64 input carries no sign
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
        P.parse_completions(body, SERVED)
    err = info.value.body()["error"]
    assert info.value.status == 400 and err["param"] == param and err["type"] == "invalid_request_error"
    assert "; fix: " in err["message"] and err["message"].startswith(param.split(".")[0])


def test_what_values_mean_is_left_to_the_engine() -> None:
    """The front checks the protocol; max_tokens against max_seq_len, sampling ranges, min_tokens
    against max_tokens and the number of stops are the engine's rules (LLMEngine.add_request)."""
    g = P.parse_completions(
        {"model": "tiny", "prompt": "p", "max_tokens": 0, "temperature": 2.5, "top_p": 0, "stop": ["a"] * 17,
         "min_tokens": 50, "stop_token_ids": [-1]},
        SERVED,
    )  # fmt: skip
    assert (g.max_tokens, g.temperature, g.top_p, len(g.stop), g.min_tokens) == (0, 2.5, 0.0, 17, 50)
    c = P.parse_chat({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 9},
                     SERVED)  # fmt: skip
    assert (c.max_tokens, c.max_tokens_param) == (9, "max_completion_tokens")


def _gen(kind: str = "completions", **kw) -> P.Generation:
    return P.Generation(kind=kind, model="tiny", **kw)


def test_model_errors_are_read_from_the_trailer_not_the_prose() -> None:
    trailer = " (error: INVALID_ARG, field: {})"
    e = model_error(
        "prompt has 3000 tokens, not below max_seq_len=2048; fix: x" + trailer.format("prompt"), _gen()
    )
    assert (e.status, e.param, e.message) == (
        400,
        "prompt",
        "prompt has 3000 tokens, not below max_seq_len=2048; fix: x",
    )
    assert model_error("too long" + trailer.format("prompt"), _gen("chat")).param == "messages"
    assert model_error("x" + trailer.format("text_input"), _gen()).param == "prompt"
    # the field the client used, whatever the message says
    msg = "prompt (10 tokens) + max_tokens=4000 exceeds max_seq_len=2048" + trailer.format("max_tokens")
    assert (
        model_error(msg, _gen("chat", max_tokens_param="max_completion_tokens")).param
        == "max_completion_tokens"
    )
    assert model_error("temperature=-1.0: bad" + trailer.format("temperature"), _gen()).param == "temperature"
    assert model_error("x" + trailer.format("sampling_param_top_k"), _gen()).param == "top_k"
    # no field named: no param, even when the message mentions one
    e = model_error("max_tokens and prompt are fine, the rest is not (error: INVALID_ARG)", _gen())
    assert (e.status, e.param) == (400, None)
    e = model_error("RuntimeError: CUDA error: an illegal memory access (error: INTERNAL)", _gen())
    assert (e.status, e.type) == (500, "server_error") and "(error:" not in e.message
    e = model_error("engine failure: the round raised (error: INTERNAL)", _gen())
    assert e.status == 500
    e = model_error("the server is shutting down (draining) (error: UNAVAILABLE)", _gen())
    assert (e.status, e.type) == (503, "server_error")
    e = model_error(
        "the engine is dead (engine failure: RuntimeError: boom); retry (error: UNAVAILABLE)", _gen()
    )
    assert (e.status, e.type, e.param) == (503, "server_error", None)
    # Triton's own errors (before the model) carry no trailer: a bad request, no param
    e = model_error("Request for unknown model: 'x' is not found", _gen())
    assert (e.status, e.param) == (400, None)


def test_response_and_chunk_shapes() -> None:
    g = P.parse_chat({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": True,
                      "stream_options": {"include_usage": True}}, SERVED)  # fmt: skip
    o = P.Outcome(choices=[P.Choice(text="hi", completion_tokens=2, finish_reason="length")], prompt_tokens=5,
                  stats={"mean_acceptance_length": 2.0000000476837, "num_rounds": 1, "total_draft_tokens": 15,
                         "total_accepted_draft_tokens": 1, "acceptance_rate": 1 / 15,
                         "total_overturned_draft_tokens": 4})  # fmt: skip
    full = P.full_response(g, "chatcmpl-1", 0, o)
    assert full["object"] == "chat.completion" and full["choices"][0]["message"]["content"] == "hi"
    assert full["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 2,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert full["dflash"] == {"mean_acceptance_length": 2.0, "num_rounds": 1, "accepted_draft_tokens": 1,
                              "draft_tokens": 15, "acceptance_rate": 0.066667, "overturned_draft_tokens": 4}  # fmt: skip
    first = P.chunk(g, "chatcmpl-1", 0, text="h", role=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "h"} and first["usage"] is None
    last = P.chunk(g, "chatcmpl-1", 0, text=None, usage_obj=P.usage(o), no_choice=True)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 2
    assert P.finish_reason("None") is None and P.finish_reason("length") == "length"


def test_n_choices_in_the_response_the_chunks_and_the_triton_inputs() -> None:
    from dflash_trt.openai_front.upstream import Upstream

    g = P.parse_completions({"model": "tiny", "prompt": "x", "n": 2, "best_of": 3, "logprobs": 1}, SERVED)
    assert (g.n, g.best_of) == (2, 3)
    o = P.Outcome(choices=[P.Choice(text="a", completion_tokens=3, finish_reason="stop",
                                    logprobs=[(5, -0.5, ((5, -0.5),))]),
                           P.Choice(text="bc", completion_tokens=4, finish_reason="length")], prompt_tokens=2)  # fmt: skip
    full = P.full_response(g, "cmpl-1", 0, o)
    assert [(c["index"], c["text"], c["finish_reason"]) for c in full["choices"]] == [
        (0, "a", "stop"),
        (1, "bc", "length"),
    ]
    assert (
        full["choices"][0]["logprobs"]["token_logprobs"] == [-0.5] and full["choices"][1]["logprobs"] is None
    )
    assert full["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 7,
        "total_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert P.chunk(g, "cmpl-1", 0, text="z", index=1)["choices"][0]["index"] == 1
    sent = {t.name(): t for t in Upstream._inputs(Upstream.__new__(Upstream), g)}
    assert (
        sent["sampling_param_n"].datatype() == "INT32"
        and sent["sampling_param_best_of"].datatype() == "INT32"
    )
    plain = {t.name() for t in Upstream._inputs(Upstream.__new__(Upstream), P.parse_completions(
        {"model": "tiny", "prompt": "x"}, SERVED))}  # fmt: skip
    assert not {"sampling_param_n", "sampling_param_best_of"} & plain


@pytest.mark.parametrize(
    ("body", "param", "problem"),
    [
        ({"n": 0}, "n", "outside [1, 128]"),
        ({"n": 2.5}, "n", "must be an integer"),
        ({"n": 3, "best_of": 2}, "best_of", "below n=3"),
        ({"best_of": 3, "stream": True}, "best_of", "cannot stream"),
    ],
)
def test_bad_n_and_best_of_are_400s_naming_the_field(body: dict, param: str, problem: str) -> None:
    with pytest.raises(P.OpenAIError) as info:
        P.parse_chat({"model": "tiny", "messages": [{"role": "user", "content": "x"}], **body}, SERVED)
    assert info.value.param == param and problem in str(info.value)


def test_stop_holdback_never_streams_a_stop_string_prefix() -> None:
    h = P.StopHoldback(["END", "\n\n"])
    assert h.delta("abc E", final=False) == "abc "  # "E" may start "END"
    assert h.delta("abc EN", final=False) == ""
    assert h.delta("abc ENx", final=False) == "ENx"  # not a stop after all
    assert h.delta("abc ENx\n", final=False) == ""
    assert h.delta("abc ENx", final=True) == ""  # the engine cut the text at "\n\n"
    h = P.StopHoldback(["END"])
    assert h.delta("ab", final=False) == "ab" and h.delta("abcd", final=True) == "cd"


def test_penalties_bias_and_min_p_reach_the_triton_inputs() -> None:
    """OpenAI's penalties and logit_bias (token ids as strings), vLLM's repetition_penalty and min_p: parsed,
    then sent as the model's sampling_param_* inputs (the bias as one JSON object)."""
    import json

    from dflash_trt.openai_front.upstream import Upstream

    g = P.parse_chat(
        {"model": "tiny", "messages": [{"role": "user", "content": "a"}], "presence_penalty": 0.5,
         "frequency_penalty": -1, "repetition_penalty": 1.2, "min_p": 0.1, "logit_bias": {"42": -100, " 7": 3.5}},
        SERVED,
    )  # fmt: skip
    assert (g.presence_penalty, g.frequency_penalty, g.repetition_penalty, g.min_p) == (0.5, -1.0, 1.2, 0.1)
    assert g.logit_bias == {42: -100.0, 7: 3.5}
    g.prompt = "a"
    sent = {t.name(): t for t in Upstream._inputs(Upstream.__new__(Upstream), g)}
    assert json.loads(sent["sampling_param_logit_bias"]._raw_content[4:].decode()) == {"42": -100.0, "7": 3.5}
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
        assert sent[f"sampling_param_{name}"].datatype() == "FP32"
    for bias in ({"a": 1}, {"1": "x"}, [1], {"1": True}):
        with pytest.raises(P.OpenAIError) as err:
            P.parse_completions({"model": "tiny", "prompt": "p", "logit_bias": bias}, SERVED)
        assert err.value.param == "logit_bias"
    with pytest.raises(P.OpenAIError) as err:
        P.parse_completions({"model": "tiny", "prompt": "p", "min_p": "high"}, SERVED)
    assert err.value.param == "min_p"
