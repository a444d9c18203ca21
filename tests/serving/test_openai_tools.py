# SPDX-License-Identifier: Apache-2.0
"""Tools and reasoning on the OpenAI front, without Triton: the request rules (tools, tool_choice,
parallel_tool_calls, reasoning_effort, assistant tool calls, tool messages), how the chat template
gets the tools (SmolLM2's real template, which has no tool convention, and a template that renders
them), and the answers the official `openai` client reads, whole and streamed, from a front whose
upstream replays scripted model text."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import openai
import pytest
from aiohttp import web

from dflash_trt.openai_front import protocol as P
from dflash_trt.openai_front.app import FrontConfig, FrontThread, build_app
from dflash_trt.openai_front.chat import ChatTemplate
from dflash_trt.openai_front.upstream import Piece, Seq
from tests.serving.conftest import fold_chat_stream, free_ports

SERVED = ["smol"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
USER = [{"role": "user", "content": "Weather in Paris?"}]
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _chat(**kw) -> P.Generation:
    return P.parse_chat({"model": "smol", "messages": USER, **kw}, SERVED)


# ------------------------------------------------------------------------------------- protocol
def test_tools_choice_and_effort_are_parsed() -> None:
    g = _chat(tools=[WEATHER, TIME])
    assert (g.tool_choice, g.tool_name, g.parallel_tool_calls) == ("auto", None, True)
    assert g.tools[0] == {"name": "get_weather", "description": "Current weather in a city",
                          "parameters": WEATHER["function"]["parameters"]}  # fmt: skip
    assert g.tools[1]["name"] == "get_time" and "description" not in g.tools[1]
    g = _chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
              parallel_tool_calls=False, reasoning_effort="high")  # fmt: skip
    assert (g.tool_choice, g.tool_name, g.parallel_tool_calls) == ("function", "get_weather", False)
    assert g.chat_template_kwargs == {"reasoning_effort": "high"} and g.guide_type is None
    assert _chat(tools=[WEATHER], tool_choice="required").tool_choice == "required"
    assert _chat(tool_choice="none").tools == []


def test_tool_conversations_are_kept_for_the_template() -> None:
    msgs = [*USER, {"role": "assistant", "content": None, "reasoning_content": "look it up",
                    "tool_calls": [{"id": "call_1", "type": "function",
                                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18 C, sunny"}]  # fmt: skip
    g = P.parse_chat({"model": "smol", "messages": msgs, "tools": [WEATHER]}, SERVED)
    assert g.messages[1] == {"role": "assistant", "content": "", "reasoning_content": "look it up", "tool_calls": [
        {"type": "function", "id": "call_1", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}  # fmt: skip
    assert g.messages[2] == {
        "role": "tool",
        "content": "18 C, sunny",
        "tool_call_id": "call_1",
        "name": "get_weather",
    }


BAD = [
    ({"tools": []}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "extra": 1}}]}, "tools[0].function.extra"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),  # no tools to choose from
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}}, "reasoning_effort"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": "f"}]}]}, "messages[0].tool_calls[0]"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_tool_fields_are_400s_naming_the_field(body: dict, param: str) -> None:
    with pytest.raises(P.OpenAIError) as info:
        P.parse_chat({"model": "smol", "messages": USER, **body}, SERVED)
    err = info.value.body()["error"]
    assert (info.value.status, err["param"]) == (400, param), err
    assert err["message"].startswith(param + "=") and "; fix: " in err["message"]


def test_a_forced_tool_call_and_a_response_format_exclude_each_other() -> None:
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        body = {"tools": [WEATHER], "tool_choice": choice,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}  # fmt: skip
        with pytest.raises(P.OpenAIError) as info:
            _chat(**body)
        assert info.value.param == "tool_choice" and "json_schema response_format" in info.value.message
    _chat(**{**body, "tool_choice": "auto"})  # auto may answer in JSON


def test_completions_still_refuses_chat_fields() -> None:
    for key, value in (("tools", [WEATHER]), ("reasoning_effort", "low"), ("tool_choice", "auto")):
        with pytest.raises(P.OpenAIError) as info:
            P.parse_completions({"model": "smol", "prompt": "x", key: value}, SERVED)
        assert info.value.param == key and "/v1/chat/completions" in info.value.message


# ------------------------------------------------------------------------------------- rendering
@pytest.fixture(scope="module")
def smol_chat() -> ChatTemplate:
    from dflash_trt.smollm2 import ensure_smollm2

    return ChatTemplate.load(str(ensure_smollm2().target))


def test_a_template_without_tools_gets_them_in_the_system_message(smol_chat) -> None:
    assert not smol_chat.format.renders_tools and not smol_chat.format.reasons
    g = _chat(tools=[WEATHER])
    prompt = smol_chat.render(g.messages, {}, g.tools)
    system = prompt.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n") and "<tool_call>" in system and "</tools>" in system
    assert json.dumps({"type": "function", "function": g.tools[0]}) in system
    assert prompt.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")
    # the client's system message is kept, the tools follow it; earlier calls and results in Hermes blocks
    msgs = [{"role": "system", "content": "Be terse."}, *USER,
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "18 C"}, {"role": "tool", "tool_call_id": "c2", "content": "9 am"}]  # fmt: skip
    prompt = smol_chat.render(P.parse_chat({"model": "smol", "messages": msgs}, SERVED).messages, {}, g.tools)
    assert prompt.startswith("<|im_start|>system\nBe terse.\n\nYou may call functions")
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
        in prompt
    )
    assert (
        "<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n<tool_response>\n9 am\n</tool_response><|im_end|>"
        in prompt
    )
    # without tools the prompt is what it always was
    assert smol_chat.render(USER, {}) == smol_chat.render(USER, {}, None) and "<tool" not in smol_chat.render(
        USER, {}
    )


def test_a_template_that_renders_tools_gets_them(smol_chat) -> None:
    import copy

    tok = copy.deepcopy(smol_chat.tokenizer)
    # a small template in Qwen3's manner (written here): tools listed, reasoning opened by the prompt
    tok.chat_template = ("{% if tools %}TOOLS:{% for t in tools %}{{ t['function']['name'] }};{% endfor %}\n{% endif %}"
                         "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                         "<|im_start|>assistant\n<think>\n{{ reasoning_effort | default('') }}")  # fmt: skip
    chat = ChatTemplate(tok, "test")
    assert chat.format.renders_tools and chat.format.think and not chat.format.harmony
    g = _chat(tools=[WEATHER, TIME], reasoning_effort="low")
    prompt = chat.render(g.messages, g.chat_template_kwargs, g.tools)
    assert prompt.startswith("TOOLS:get_weather;get_time;<|im_start|>user") and prompt.endswith(
        "<think>\nlow"
    )
    assert "You may call functions" not in prompt


# ------------------------------------------------------------------------------------- served
class _Scripted:
    """An upstream that answers every request with `text`, cut into 3-character pieces."""

    def __init__(self) -> None:
        self.text = ""
        self.seen: list[P.Generation] = []

    async def generate(self, gen: P.Generation, rid: str) -> AsyncIterator[Piece]:
        self.seen.append(gen)
        step = 3 if gen.stream else len(self.text)
        for i in range(0, len(self.text), step):
            last = i + step >= len(self.text)
            yield Piece(seqs=[Seq(self.text[i : i + step], i // step + 1, "stop" if last else None)],
                        prompt_tokens=7, final=last)  # fmt: skip

    async def ready(self) -> bool:
        return True

    async def close(self) -> None:
        return None


class _Front(FrontThread):
    def __init__(self, cfg: FrontConfig, chat: ChatTemplate, upstream: _Scripted) -> None:
        super().__init__(cfg, chat)
        self.upstream = upstream

    async def _serve(self) -> None:
        self._runner = web.AppRunner(build_app(self.cfg, self.upstream, self.chat), handler_cancellation=True)  # type: ignore[arg-type]
        await self._runner.setup()
        await web.TCPSite(self._runner, self.cfg.host, self.cfg.port).start()


@pytest.fixture(scope="module")
def front(smol_chat):
    up = _Scripted()
    (port,) = free_ports(1)
    f = _Front(FrontConfig("unused:1", "m", SERVED, port=port, max_seq_len=2048), smol_chat, up).start()
    with openai.OpenAI(base_url=f.url + "/v1", api_key="x", max_retries=0, timeout=30) as client:
        yield client, up
    f.stop()


def _stream(client, **kw) -> tuple[str, list, str, list]:
    chunks = list(client.chat.completions.create(model="smol", messages=USER, stream=True, **kw))
    return (*fold_chat_stream(chunks), chunks)


def test_tool_calls_reach_the_openai_client_whole_and_streamed(front) -> None:
    client, up = front
    up.text = "Checking.\n" + CALL_TEXT
    r = client.chat.completions.create(model="smol", messages=USER, tools=[WEATHER])
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == "Checking."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert msg.tool_calls[0].id.startswith("call_") and msg.tool_calls[0].type == "function"
    assert up.seen[-1].guide_type is None and "<tool_call>" in up.seen[-1].prompt  # auto: no grammar
    content, calls, finish, chunks = _stream(client, tools=[WEATHER])
    assert (content, finish) == ("Checking.", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert all("<tool" not in (c.choices[0].delta.content or "") for c in chunks)
    first_call = next(c.choices[0].delta.tool_calls[0] for c in chunks if c.choices[0].delta.tool_calls)
    assert first_call.function.arguments == "" and first_call.type == "function"


def test_required_and_named_choices_send_a_guide_and_none_parses_nothing(front) -> None:
    client, up = front
    up.text = CALL_TEXT
    client.chat.completions.create(model="smol", messages=USER, tools=[WEATHER, TIME], tool_choice="required")
    sent = up.seen[-1]
    assert sent.guide_type == "structural_tag" and '"stop_after_first": false' in sent.guide
    assert "get_weather" in sent.guide and "get_time" in sent.guide
    client.chat.completions.create(model="smol", messages=USER, tools=[WEATHER, TIME],
                                   tool_choice={"type": "function", "function": {"name": "get_time"}})  # fmt: skip
    sent = up.seen[-1]
    assert '"stop_after_first": true' in sent.guide and "get_weather" not in sent.guide
    r = client.chat.completions.create(model="smol", messages=USER, tools=[WEATHER], tool_choice="none")
    assert r.choices[0].message.content == CALL_TEXT and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop" and "<tool_call>" not in up.seen[-1].prompt


def test_plain_answers_are_unchanged(front) -> None:
    client, up = front
    up.text = "Paris is sunny. <tool_call> is just text without tools."
    r = client.chat.completions.create(model="smol", messages=USER)
    assert r.choices[0].message.content == up.text and r.choices[0].finish_reason == "stop"
    assert "reasoning_content" not in r.choices[0].message.model_extra
    assert _stream(client)[0] == up.text


def test_reasoning_and_harmony_calls_reach_the_client(smol_chat) -> None:
    """A gpt-oss-like template (harmony markers): analysis is reasoning_content, a function message a
    tool call; streamed deltas keep them apart (the sample is hand-written in the documented format)."""
    import copy

    tok = copy.deepcopy(smol_chat.tokenizer)
    tok.chat_template = ("{% for m in messages %}<|start|>{{ m['role'] }}{% if m['role'] == 'assistant' %}<|channel|>final"
                         "{% endif %}<|message|>{{ m['content'] }}<|end|>{% endfor %}{% if tools %}{% endif %}<|start|>assistant")  # fmt: skip
    chat = ChatTemplate(tok, "harmony-like")
    assert chat.format.harmony and chat.format.reasons
    up = _Scripted()
    up.text = ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
               'to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>')  # fmt: skip
    (port,) = free_ports(1)
    f = _Front(FrontConfig("unused:1", "m", SERVED, port=port), chat, up).start()
    try:
        with openai.OpenAI(base_url=f.url + "/v1", api_key="x", max_retries=0, timeout=30) as client:
            r = client.chat.completions.create(
                model="smol", messages=USER, tools=[WEATHER], reasoning_effort="low"
            )
            msg = r.choices[0].message
            assert msg.model_extra["reasoning_content"] == "Need weather." and msg.content is None
            assert (msg.tool_calls[0].function.name, msg.tool_calls[0].function.arguments) == (
                "get_weather",
                '{"city":"Paris"}',
            )
            assert up.seen[-1].chat_template_kwargs == {"reasoning_effort": "low"}
            reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or ""
                                for c in client.chat.completions.create(model="smol", messages=USER, tools=[WEATHER], stream=True))  # fmt: skip
            assert reasoning == "Need weather."
            _, calls, finish, _ = _stream(client, tools=[WEATHER])
            assert finish == "tool_calls" and [(c["name"], c["arguments"]) for c in calls] == [
                ("get_weather", '{"city":"Paris"}')
            ]
            up.text = "<|channel|>final<|message|>Sunny.<|return|>"
            r = client.chat.completions.create(model="smol", messages=USER)
            assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("Sunny.", "stop")
    finally:
        f.stop()


def test_guide_for_the_harmony_format_uses_its_tokens() -> None:
    from dflash_trt.openai_front.parsers.guides import tool_call_guide

    kind, text = tool_call_guide([{"name": "f", "parameters": {"type": "object"}}], harmony=True, one=True)
    assert (
        kind == "structural_tag"
        and '"token": "<|constrain|>"' in text
        and "commentary to=functions.f " in text
    )


def test_a_harmony_template_asks_the_model_to_keep_special_tokens() -> None:
    """gpt-oss's channel markers are special tokens: the front asks Triton for them
    (sampling_param_skip_special_tokens false), and for no other template."""
    from dflash_trt.openai_front import app
    from dflash_trt.openai_front.parsers import OutputFormat
    from dflash_trt.openai_front.upstream import Upstream

    for template, keep in (
        ("<|start|>{{ m }}<|channel|>final<|message|>", True),
        ("<|im_start|>{{ m }}", False),
    ):
        gen = P.parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}]}, ["m"])
        gen.prompt = "x"
        app._answer_format(gen, OutputFormat.of(template))
        names = {i.name(): i for i in Upstream._inputs(None, gen)}  # type: ignore[arg-type]
        assert ("sampling_param_skip_special_tokens" in names) is keep
        if keep:
            assert names["sampling_param_skip_special_tokens"].datatype() == "BOOL"


def test_a_forced_call_beside_another_guide_is_refused() -> None:
    with pytest.raises(P.OpenAIError) as err:
        _chat(tools=[WEATHER], tool_choice="required", structured_outputs={"regex": "a+"})
    assert err.value.param == "tool_choice" and "structured_outputs" in err.value.message
