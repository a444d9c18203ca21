# SPDX-License-Identifier: Apache-2.0
"""OpenAI request bodies in, one `Generation` out; response bodies and the error shape.

Pure functions over JSON values (no I/O). What is checked here is the protocol: the endpoint's
fields, JSON types, what this front does not support, and ranges the Triton inputs cannot carry
(INT32, UINT64). A bad or unsupported field raises `OpenAIError` (HTTP 400, OpenAI's
`{"error": {message, type, param, code}}`) whose message names the field, the value and the fix.
What a value means (max_tokens against max_seq_len, sampling ranges, min_tokens, stop ids) is the
engine's rule (`LLMEngine.add_request`): its refusal comes back through Triton naming the field,
and `upstream.model_error` turns it into the same 400.

Supported: `max_tokens` / `max_completion_tokens`, `temperature`, `top_p`, `top_k`, `seed`,
`stop` (strings), `n=1`, `stream`, `stream_options.include_usage`, `frequency_penalty`,
`presence_penalty`, `logit_bias` (token-id strings -> bias); extensions as in vLLM: `stop_token_ids`,
`ignore_eos`, `min_tokens`, `repetition_penalty`, `min_p`, `stream_options.continuous_usage_stats` (usage
on every chunk), `chat_template_kwargs`, log-probabilities (completions' `logprobs: 0..5`, chat's
`logprobs: true` with `top_logprobs: 0..20`; not streamed yet); structured outputs on both endpoints
(`_structured`): `response_format` (text, json_object, json_schema), vLLM's `structured_outputs` (json,
regex, choice, grammar, json_object, structural_tag) and its older `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar`, one guide per request. Refused with 400: `n>1`, `best_of>1`,
`logprobs` with `stream`, `echo`, `suffix`, `functions`, tools on completions, non-text content, token-id prompts,
and any key not listed here.

Chat also serves tools and reasoning (`_tools`, `_reasoning_effort`, `_message`): `tools` (functions
with name, description and a JSON-schema `parameters`), `tool_choice` (`none`, `auto` (the default
with tools), `required`, or `{"type": "function", "function": {"name": ...}}` naming one of them),
`parallel_tool_calls`, `reasoning_effort` (low / medium / high: the template's `reasoning_effort`),
assistant messages with `tool_calls` (content may be null) and `reasoning_content`, and `tool`
messages with `tool_call_id`. A required or named choice becomes a guide (parsers/guides.py) and is
refused next to a JSON response_format. The answer is read by the template's parser (parsers/):
`message.tool_calls` with `finish_reason: "tool_calls"`, `message.reasoning_content` (vLLM's name)
when the template reasons; streamed deltas carry `reasoning_content`, `content` and `tool_calls`
apart. `functions` / `function_call` (the deprecated form) stay refused.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dflash_trt.openai_front import guides
from dflash_trt.openai_front.parsers import OutputParser, collect

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
INT32 = (-(2**31), 2**31 - 1)  # what an INT32 Triton input carries
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default (the engines' own default, all-None, would be greedy)
MAX_CHOICES = 128  # n and best_of: the engine refuses more than its max_batch_size

# The extension object that carries the DFlash statistics of one response: its keys, and the
# Triton model output each comes from (clients such as `dflash-trt bench` map them back).
DFLASH_FIELD = "dflash"
DFLASH_STATS = {
    "mean_acceptance_length": "mean_acceptance_length",  # tau: tokens per round, bonus included
    "num_rounds": "num_rounds",
    "accepted_draft_tokens": "total_accepted_draft_tokens",
    "draft_tokens": "total_draft_tokens",
    "acceptance_rate": "acceptance_rate",
    "overturned_draft_tokens": "total_overturned_draft_tokens",  # DFlash 2: selector picks over the argmax
}


class OpenAIError(Exception):
    """An error answered in OpenAI's JSON shape."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.type = type
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, value: Any, problem: str, fix: str, *, code: str | None = None) -> OpenAIError:
    """A 400 naming the field, its value and the fix (one line)."""
    shown = json.dumps(value) if not isinstance(value, str) else repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return OpenAIError(f"{param}={shown}: {problem}; fix: {fix}", param=param, code=code)


@dataclass
class Generation:
    """One validated request, in the Triton model's terms."""

    kind: str  # "completions" | "chat"
    model: str
    prompt: str | None = None  # completions: the prompt text; chat: filled in by the chat template
    messages: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None  # None: the model's default (chat: app.py fills in what the context leaves)
    max_tokens_param: str = "max_tokens"  # the field the client used: max_tokens or max_completion_tokens
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # alternatives per token (completions' logprobs, chat's top_logprobs)
    n: int = 1  # choices, sampled from one prefill of the prompt
    best_of: int | None = None  # candidates of which the n most likely are returned (not streamed)
    echo: bool = False  # completions: the prompt before each choice's text (and its log-probabilities)
    bad_words: list[str] = field(default_factory=list)  # vLLM's: words never generated
    # guided decoding, in the Triton model's terms (guided_decoding_guide_type / _guide): one of
    # engine/request.py's GUIDE_TYPES and its text ("" for "json": any JSON value)
    guide_type: str | None = None
    guide: str = ""
    guide_param: str = "response_format"  # the request field the guide came from (errors name it)
    # chat's tools: the offered functions ({name, description, parameters}), the choice ("none",
    # "auto", "required" or "function": then tool_name), and whether several calls may come at once
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str = "none"
    tool_name: str | None = None
    parallel_tool_calls: bool = True
    # chat: a fresh output parser per choice (parsers.OutputFormat.parser; None: all text is content),
    # and whether answers carry reasoning_content (the template reasons)
    parser: Callable[[], OutputParser | None] | None = None
    reasons: bool = False
    keep_special_tokens: bool = False  # the parser reads special tokens (harmony's markers) in the text
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False


# ---------------------------------------------------------------------------------------- fields
# key -> the value(s) accepted because they mean "off"/default (anything else is refused).
_OFF_ONLY: dict[str, tuple[Any, ...]] = {
    "echo": (None, False),
    "suffix": (None, ""),
    "tools": (None,),
    "functions": (None,),
    "tool_choice": (None, "none"),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None, True, False),  # meaningless without tools
    "audio": (None,),
    "modalities": (None,),
    "prediction": (None,),
    "web_search_options": (None,),
    "reasoning_effort": (None,),
    "store": (None, False),
}
_WHY = {
    "echo": ("echo is a /v1/completions field", "omit echo"),
    "suffix": ("insertion (suffix) is not supported", "omit suffix"),
    "tools": ("tool calling is a /v1/chat/completions field", "omit tools"),
    "functions": ("function calling is not supported", "omit functions"),
    "tool_choice": ("tool calling is a /v1/chat/completions field", "omit tool_choice"),
    "function_call": ("function calling is not supported", "omit function_call"),
    "parallel_tool_calls": ("tool calling is a /v1/chat/completions field", "omit parallel_tool_calls"),
    "audio": ("audio output is not supported", "omit audio"),
    "modalities": ("only text output is supported", 'omit modalities or send ["text"]'),
    "prediction": ("predicted outputs are not supported", "omit prediction"),
    "web_search_options": ("web search is not supported", "omit web_search_options"),
    "reasoning_effort": ("reasoning_effort is a /v1/chat/completions field", "omit reasoning_effort"),
    "store": ("stored completions are not supported", "omit store or send false"),
}
# Served on chat only (refused on completions, as _OFF_ONLY says).
_CHAT_SERVED = frozenset({"tools", "tool_choice", "parallel_tool_calls", "reasoning_effort"})
# Accepted and ignored: they do not change what is generated.
_IGNORED = frozenset({"user", "metadata", "service_tier", "stream_options"})
_COMMON = frozenset({"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
                     "ignore_eos", "min_tokens", "stream", "stream_options", "logprobs", "frequency_penalty",
                     "presence_penalty", "repetition_penalty", "min_p", "logit_bias", "n",
                     "best_of", "bad_words"})  # fmt: skip
# the distribution's fields (spec/penalties.py): numbers the engine range-checks
_PENALTIES = {"frequency_penalty": "send a number in [-2, 2]; 0 = off", "presence_penalty": "send a number in [-2, 2]; 0 = off",
              "repetition_penalty": "send a number > 0; 1 = off", "min_p": "send a number in [0, 1]; 0 = off"}  # fmt: skip
# structured outputs (`_structured`), on both endpoints
_GUIDE_KEYS = frozenset({"response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                         "guided_grammar"})  # fmt: skip
_COMPLETIONS_KEYS = _COMMON | {"prompt"} | set(_OFF_ONLY) | _IGNORED | _GUIDE_KEYS
_CHAT_KEYS = (
    _COMMON
    | {"messages", "max_completion_tokens", "chat_template_kwargs", "top_logprobs"}
    | set(_OFF_ONLY)
    | _IGNORED
    | _GUIDE_KEYS
)


def _check_keys(body: dict[str, Any], allowed: frozenset[str] | set[str], endpoint: str) -> None:
    for key in body:
        if key not in allowed:
            raise bad(key, body[key], f"{endpoint} does not support this parameter", f"remove {key}")
    for key, ok in _OFF_ONLY.items():
        if key == "echo" and endpoint == "/v1/completions":
            continue  # served there (parse_completions)
        if key in _CHAT_SERVED and endpoint == "/v1/chat/completions":
            continue  # served there (_tools, _reasoning_effort)
        if key in body and body[key] not in ok and not (key == "modalities" and body[key] == ["text"]):
            problem, fix = _WHY[key]
            raise bad(key, body[key], problem, fix)


def _int(body: dict[str, Any], key: str, *, lo: int, hi: int, fix: str) -> int | None:
    """An integer field within what its Triton input carries (lo..hi)."""
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(key, v, "must be an integer", fix)
    if not lo <= v <= hi:
        raise bad(key, v, f"is outside [{lo}, {hi}], what its Triton input carries", fix)
    return v


def _float(body: dict[str, Any], key: str, *, fix: str) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise bad(key, v, "must be a number", fix)
    return float(v)


def _bool(body: dict[str, Any], key: str, *, prefix: str = "") -> bool:
    v = body.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(prefix + key, v, "must be true or false", f"send a JSON boolean for {key}")
    return v


def _common(body: dict[str, Any], gen: Generation, served: list[str]) -> None:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad(
            "model", model, "is required (a string)", f"send one of {', '.join(served)} (GET /v1/models)"
        )
    if model not in served:
        raise bad("model", model, "is not served here", f"send one of {', '.join(served)} (GET /v1/models)",
                  code="model_not_found")  # fmt: skip
    gen.model = model
    temperature = _float(body, "temperature", fix="send a number; 0 is greedy")
    gen.temperature = DEFAULT_TEMPERATURE if temperature is None else temperature
    gen.top_p = _float(body, "top_p", fix="send a number in (0, 1], 1 = off")
    top_k = body.get("top_k")
    if top_k == -1:  # vLLM's "off"
        top_k = 0
    gen.top_k = _int(
        {"top_k": top_k}, "top_k", lo=INT32[0], hi=INT32[1], fix="send an integer >= 0 (0 or -1 = off)"
    )
    gen.seed = _int(body, "seed", lo=0, hi=2**64 - 1, fix="send a non-negative integer")  # UINT64
    _stops(body, gen)
    gen.ignore_eos = _bool(body, "ignore_eos")
    gen.min_tokens = _int(body, "min_tokens", lo=INT32[0], hi=INT32[1], fix="send an integer >= 0")
    for key, fix in _PENALTIES.items():
        setattr(gen, key, _float(body, key, fix=fix))
    gen.logit_bias = _logit_bias(body.get("logit_bias"))
    gen.stream = _bool(body, "stream")
    _choices(body, gen)
    opts = body.get("stream_options")
    if opts is not None:
        if not gen.stream:
            raise bad(
                "stream_options", opts, "is only allowed with stream=true", "omit it or send stream=true"
            )
        if not isinstance(opts, dict):
            raise bad("stream_options", opts, "must be an object", 'send e.g. {"include_usage": true}')
        for key in opts:
            if key not in ("include_usage", "continuous_usage_stats"):
                raise bad(f"stream_options.{key}", opts[key], "is not supported",
                          "use include_usage (or continuous_usage_stats)")  # fmt: skip
        gen.include_usage = _bool(opts, "include_usage", prefix="stream_options.")
        gen.continuous_usage = _bool(opts, "continuous_usage_stats", prefix="stream_options.")


def _stops(body: dict[str, Any], gen: Generation) -> None:
    """stop strings, stop_token_ids and bad_words (vLLM's)."""
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise bad("stop", body.get("stop"), "must be a non-empty string or a list of non-empty strings",
                      "send stop strings; stop token ids go in stop_token_ids")  # fmt: skip
        gen.stop = list(stop)
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and INT32[0] <= i <= INT32[1] for i in ids
        ):
            raise bad("stop_token_ids", ids, "must be a list of token ids (integers)", "send e.g. [2]")
        gen.stop_token_ids = list(ids)
    words = body.get("bad_words")
    if words is not None:
        if not isinstance(words, list) or not all(isinstance(w, str) and w for w in words):
            raise bad("bad_words", words, "must be a list of non-empty strings", 'send e.g. ["darn"]')
        gen.bad_words = list(words)


def _choices(body: dict[str, Any], gen: Generation) -> None:
    """n choices, and best_of candidates to pick them from (vLLM's extension on chat)."""
    gen.n = _int(body, "n", lo=1, hi=MAX_CHOICES, fix=f"send an integer in [1, {MAX_CHOICES}]") or 1
    gen.best_of = _int(body, "best_of", lo=1, hi=MAX_CHOICES, fix=f"send an integer in [n, {MAX_CHOICES}]")
    if gen.best_of is not None and gen.best_of < gen.n:
        raise bad("best_of", gen.best_of, f"is below n={gen.n}", "send best_of >= n, or omit it")
    if gen.best_of is not None and gen.best_of > gen.n and gen.stream:
        raise bad("best_of", gen.best_of, "cannot stream: the best choices are known only when all end",
                  "omit best_of, or send stream: false")  # fmt: skip


def _logit_bias(value: Any) -> dict[int, float]:
    """OpenAI's logit_bias: an object from token ids (as strings) to biases (the engine checks ranges)."""
    if value is None:
        return {}
    fix = 'send an object from token ids to biases in [-100, 100], e.g. {"50256": -100}'
    if not isinstance(value, dict):
        raise bad("logit_bias", value, "must be an object", fix)
    out = {}
    for key, bias in value.items():
        token = key.strip() if isinstance(key, str) else ""
        if not token.isdigit() or isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise bad("logit_bias", {key: bias}, "each key must be a token id and each value a number", fix)
        if not int(token) <= INT32[1]:
            raise bad("logit_bias", {key: bias}, "the token id is outside what its Triton input carries", fix)
        out[int(token)] = float(bias)
    return out


def _chat_logprobs(body: dict[str, Any], gen: Generation) -> None:
    """Chat's logprobs (a boolean) and top_logprobs (0..20 alternatives per token, only with logprobs)."""
    on, top = body.get("logprobs"), body.get("top_logprobs")
    if on is not None and not isinstance(on, bool):
        raise bad("logprobs", on, "must be true or false", "send logprobs: true and top_logprobs: 0..20")
    if top is not None and not on:
        raise bad("top_logprobs", top, "needs logprobs: true", "send logprobs: true, or omit top_logprobs")
    if on:
        gen.logprobs = _int(body, "top_logprobs", lo=0, hi=20, fix="send an integer in [0, 20]") or 0


def logprobs_body(gen: Generation, rows: list[Any] | None, token_text: Any, *, offset: int = 0) -> Any:
    """OpenAI's logprobs object for `rows` (one per token: (id, log-probability, alternatives)) of a
    choice: completions' {tokens, token_logprobs, top_logprobs, text_offset} (offsets from `offset`
    characters), chat's {content: [{token, logprob, bytes, top_logprobs}]}. `token_text(id)` names a
    token. A streamed chunk carries its own tokens' rows."""
    if gen.logprobs is None or rows is None:
        return None
    k = gen.logprobs
    if gen.kind == "chat":

        def entry(t: int, lp: float) -> dict[str, Any]:
            text = token_text(t)
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

        return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in top[:k]]}
                            for t, lp, top in rows]}  # fmt: skip
    tokens = [token_text(t) for t, _, _ in rows]
    offsets = [offset + sum(len(x) for x in tokens[:i]) for i in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in rows],
            "top_logprobs": [{token_text(a): alp for a, alp in top[:k]} for _, _, top in rows],
            "text_offset": offsets}  # fmt: skip


def echo_logprobs(gen: Generation, o: Outcome, choice: Choice, token_text: Any) -> Any:
    """Completions' logprobs object with echo: the prompt's tokens first (the first has no
    log-probability: null), then the choice's."""
    body = logprobs_body(gen, o.prompt_logprobs or [], token_text)
    first = token_text(o.prompt_ids[0]) if o.prompt_ids else ""
    rest = logprobs_body(gen, choice.logprobs or [], token_text, offset=len(gen.prompt or ""))
    return {"tokens": [first, *body["tokens"], *rest["tokens"]],
            "token_logprobs": [None, *body["token_logprobs"], *rest["token_logprobs"]],
            "top_logprobs": [None, *body["top_logprobs"], *rest["top_logprobs"]],
            "text_offset": [0, *(len(first) + x for x in body["text_offset"]), *rest["text_offset"]]}  # fmt: skip


# ------------------------------------------------------------------------------ structured outputs
# vLLM's structured_outputs keys (each one guide) and the older top-level guided_* fields
# OpenAI's and vLLM's json_object: a JSON object (the Triton model's "json" guide allows any JSON value,
# TensorRT-LLM's rule)
ANY_OBJECT = '{"type": "object"}'
_SO_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_TEXT_KINDS = {
    "regex": "regex",
    "grammar": "ebnf_grammar",
    "structural_tag": "structural_tag",
}  # key -> guide type
_FIXES = {  # guide type -> how to send one that compiles
    "json_schema": "send a JSON Schema that xgrammar supports",
    "regex": "send a regular expression that xgrammar supports (no lookaround or backreferences)",
    "ebnf_grammar": 'send an EBNF grammar in xgrammar\'s syntax with a root rule, e.g. root ::= "yes" | "no"',
    "structural_tag": "send an xgrammar structural tag as JSON text",
}
_SCHEMA_FIELDS = {
    "name": str,
    "schema": dict,
    "strict": bool,
    "description": str,
}  # OpenAI's json_schema object
_SCHEMA_FIX = 'send e.g. {"name": "answer", "schema": {"type": "object"}, "strict": true}'
_Guide = tuple[str, Any, str, str]  # (the field errors name, its value, guide type, guide text)


def _structured(body: dict[str, Any], gen: Generation) -> None:
    """The request's guide (at most one, from response_format, structured_outputs or a guided_* field) as
    the Triton model's guide type and text, compiled here when xgrammar is installed (guides.py)."""
    found: list[_Guide] = []
    if body.get("response_format") is not None:
        found += _response_format(body["response_format"])
    if body.get("structured_outputs") is not None:
        found.append(_structured_outputs(body["structured_outputs"]))
    found += [_guide(key, kind, body[key]) for key, kind in _GUIDED.items() if body.get(key) is not None]
    if len(found) > 1:
        raise bad(found[1][0], found[1][1], f"is a second guide beside {found[0][0]}",
                  "send one guide: response_format, structured_outputs or one guided_* field")  # fmt: skip
    if not found:
        return
    param, value, kind, text = found[0]
    error = guides.compile_error(kind, text) if text != ANY_OBJECT else None  # ours compiles: no import
    if error is not None:
        raise bad(param, value, f"does not compile: {error}", _FIXES[kind])
    gen.guide_param, gen.guide_type, gen.guide = param, kind, text


def _response_format(fmt: Any) -> list[_Guide]:
    """OpenAI's response_format: text (no guide), json_object (any JSON object) or json_schema."""
    kinds = ("text", "json_object", "json_schema")
    if not isinstance(fmt, dict) or fmt.get("type") not in kinds:
        raise bad("response_format", fmt, f"must be an object whose type is one of {', '.join(kinds)}",
                  'send {"type": "json_schema", "json_schema": {...}}, {"type": "json_object"} or {"type": "text"}')  # fmt: skip
    kind = fmt["type"]
    for key in fmt:
        if key != "type" and not (key == "json_schema" and kind == "json_schema"):
            raise bad(f"response_format.{key}", fmt[key], f"is not a field of a {kind} response_format",
                      f"remove {key}")  # fmt: skip
    if kind == "text":
        return []
    if kind == "json_object":
        return [("response_format", fmt, "json_schema", ANY_OBJECT)]
    return [_json_schema(fmt.get("json_schema"))]


def _json_schema(spec: Any) -> _Guide:
    """response_format's json_schema object: a name, the schema (a JSON object), strict, description."""
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise bad(where, spec, "is required (an object)", _SCHEMA_FIX)
    for key, value in spec.items():
        want = _SCHEMA_FIELDS.get(key)
        if want is None:
            raise bad(f"{where}.{key}", value, "is not supported", f"remove {key}; {_SCHEMA_FIX}")
        if not isinstance(value, want) and not (key == "strict" and value is None):
            kind = "an object" if want is dict else f"a {want.__name__}"
            raise bad(f"{where}.{key}", value, f"must be {kind}", _SCHEMA_FIX)
    for key in ("name", "schema"):
        if key not in spec or (key == "name" and not spec[key]):
            raise bad(f"{where}.{key}", spec.get(key), "is required",
                      f'{_SCHEMA_FIX} (for any JSON object: response_format {{"type": "json_object"}})')  # fmt: skip
    return f"{where}.schema", spec["schema"], "json_schema", json.dumps(spec["schema"])


def _structured_outputs(so: Any) -> _Guide:
    """vLLM's structured_outputs: an object that sets exactly one of _SO_KEYS."""
    fix = f"send an object with exactly one of {', '.join(_SO_KEYS)}"
    if not isinstance(so, dict):
        raise bad("structured_outputs", so, "must be an object", fix)
    for key in so:
        if key not in _SO_KEYS:
            raise bad(f"structured_outputs.{key}", so[key], "is not supported", f"remove {key}; {fix}")
    keys = [k for k in _SO_KEYS if so.get(k) not in (None, False)]
    if len(keys) != 1:
        raise bad("structured_outputs", so, f"sets {len(keys)} guides ({', '.join(keys) or 'none'})", fix)
    return _guide(f"structured_outputs.{keys[0]}", keys[0], so[keys[0]])


def _guide(param: str, key: str, value: Any) -> _Guide:
    """One of vLLM's guide fields (`key`, one of _SO_KEYS) as a guide type and text."""
    if key == "json":
        text = guides.schema_text(value)
        if text is None:
            raise bad(param, value, "must be a JSON Schema: a JSON object, or its text", 'send e.g. {"type": "object"}')  # fmt: skip
        return param, value, "json_schema", text
    if key == "json_object":
        if value is not True:
            raise bad(param, value, "must be true", "send true for any JSON object, or omit it")
        return param, value, "json_schema", ANY_OBJECT
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise bad(param, value, "must be a non-empty list of strings", 'send e.g. ["yes", "no"]')
        return param, value, "ebnf_grammar", guides.choice_grammar(value)
    text = json.dumps(value) if key == "structural_tag" and isinstance(value, dict) else value
    if not isinstance(text, str) or not text:
        raise bad(param, value, "must be a non-empty string", _FIXES[_TEXT_KINDS[key]])
    return param, value, _TEXT_KINDS[key], text


def _max_tokens(gen: Generation, key: str, value: Any) -> None:
    """max_tokens (or chat's max_completion_tokens), as far as the INT32 input carries it."""
    if value is None:
        return
    gen.max_tokens = _int({key: value}, key, lo=INT32[0], hi=INT32[1], fix=f"send {key} >= 1")
    gen.max_tokens_param = key


def _begin(body: Any, served: list[str], *, kind: str) -> tuple[dict[str, Any], Generation]:
    """The body as an object of the endpoint's keys, and a Generation with the fields both share."""
    body = _object(body)
    if kind == "chat":
        _check_keys(body, _CHAT_KEYS, "/v1/chat/completions")
    else:
        _check_keys(body, _COMPLETIONS_KEYS, "/v1/completions")
    gen = Generation(kind=kind, model="")
    _common(body, gen, served)
    return body, gen


def parse_completions(body: Any, served: list[str]) -> Generation:
    """POST /v1/completions."""
    body, gen = _begin(body, served, kind="completions")
    lp = body.get("logprobs")
    if lp is not None:  # OpenAI's completions: 0..5 alternatives per token
        gen.logprobs = _int(body, "logprobs", lo=0, hi=5, fix="send an integer in [0, 5]")
    gen.echo = _bool(body, "echo")
    if gen.echo and gen.stream and gen.logprobs is not None:
        raise bad("echo", True, "the prompt's log-probabilities are not streamed",
                  "send stream: false to score the prompt, or omit logprobs")  # fmt: skip
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            raise bad("prompt", prompt, "several prompts in one request are not supported",
                      "send one prompt per request")  # fmt: skip
        if isinstance(prompt, list) and prompt and all(isinstance(p, (int, list)) for p in prompt):
            raise bad("prompt", prompt, "token-id prompts are not supported (the model takes text)",
                      "send the prompt as a string")  # fmt: skip
        raise bad("prompt", prompt, "is required (a non-empty string)", "send a prompt string")
    if not prompt:
        raise bad("prompt", prompt, "is empty", "send a non-empty prompt string")
    gen.prompt = prompt
    _structured(body, gen)
    gen.max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    _max_tokens(gen, "max_tokens", body.get("max_tokens"))
    return gen


def scores_prompt(gen: Generation) -> bool:
    """Whether the model must score the prompt: echo with logprobs, or echo alone with max_tokens 0 (the
    engine takes max_tokens 0 only from a request that scores its prompt)."""
    return gen.echo and (gen.logprobs is not None or gen.max_tokens == 0)


def parse_chat(body: Any, served: list[str]) -> Generation:
    """POST /v1/chat/completions (the prompt text is rendered later by the chat template)."""
    body, gen = _begin(body, served, kind="chat")
    _chat_logprobs(body, gen)
    _structured(body, gen)
    gen.messages = _messages(body.get("messages"))
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise bad(
                "chat_template_kwargs", kwargs, "must be an object", 'send e.g. {"enable_thinking": false}'
            )
        reserved = {"messages", "add_generation_prompt", "tokenize", "conversation", "tools"} & set(kwargs)
        if reserved:
            key = sorted(reserved)[0]
            raise bad(f"chat_template_kwargs.{key}", kwargs[key], "is set by the server", f"remove {key}")
        gen.chat_template_kwargs = dict(kwargs)
    _tools(body, gen)
    _reasoning_effort(body, gen)
    a, b = body.get("max_tokens"), body.get("max_completion_tokens")
    if a is not None and b is not None and a != b:
        raise bad("max_completion_tokens", b, f"differs from max_tokens={a}", "send only one of the two")
    _max_tokens(gen, "max_completion_tokens" if b is not None else "max_tokens", b if b is not None else a)
    return gen


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object; fix: send a JSON object", param=None)
    return body


def _messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise bad("messages", messages, "is required (a non-empty list)",
                  'send e.g. [{"role": "user", "content": "Hi"}]')  # fmt: skip
    return [_message(f"messages[{i}]", m) for i, m in enumerate(messages)]


# per role, the keys a message may carry besides role and content
_MESSAGE_KEYS = {"system": ("name",), "developer": ("name",), "user": ("name",),
                 "assistant": ("name", "tool_calls", "reasoning_content"), "tool": ("tool_call_id", "name")}  # fmt: skip


def _message(where: str, m: Any) -> dict[str, Any]:
    """One message as the chat template takes it: text content; an assistant's tool calls (their
    arguments as objects, as Hugging Face templates read them); a tool result's call id."""
    if not isinstance(m, dict):
        raise bad(
            where, m, "must be an object with role and content", 'send {"role": "user", "content": "..."}'
        )
    role = m.get("role")
    if role not in _MESSAGE_KEYS:
        fix = "send a system, user, assistant or tool message"
        raise bad(f"{where}.role", role, f"role must be one of {', '.join(_MESSAGE_KEYS)}", fix)
    for key in m:
        if key != "role" and key != "content" and key not in _MESSAGE_KEYS[role]:
            raise bad(f"{where}.{key}", m[key], f"is not supported on a {role} message", f"remove {key}")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role}
    if role == "assistant" and m.get("tool_calls") is not None:
        out["tool_calls"] = _message_calls(f"{where}.tool_calls", m["tool_calls"])
        out["content"] = "" if m.get("content") is None else _text(f"{where}.content", m["content"])
    else:
        out["content"] = _text(f"{where}.content", m.get("content"))
    if role == "tool":
        call = m.get("tool_call_id")
        if not isinstance(call, str) or not call:
            raise bad(f"{where}.tool_call_id", call, "is required on a tool message (a string)",
                      "send the id of the tool call this message answers")  # fmt: skip
        out["tool_call_id"] = call
    for key in ("name", "reasoning_content"):
        if m.get(key) is not None and not isinstance(m[key], str):
            raise bad(f"{where}.{key}", m[key], "must be a string", f"send {key} as a string, or omit it")
    if m.get("reasoning_content") is not None:
        out["reasoning_content"] = m["reasoning_content"]  # Qwen3's template reads it
    if role == "tool" and m.get("name") is not None:
        out["name"] = m["name"]  # a tool result's function (a user's name is not rendered)
    return out


def _text(where: str, content: Any) -> str:
    """A message's content: a string or a list of text parts."""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise bad(f"{where}[{j}]", part, "only text parts are supported",
                          'send {"type": "text", "text": "..."}')  # fmt: skip
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise bad(where, content, "must be a string or a list of text parts", "send text content")
    return content


def _message_calls(where: str, calls: Any) -> list[dict[str, Any]]:
    """An assistant message's tool_calls: [{id, type: "function", function: {name, arguments}}]."""
    fix = 'send [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]'
    if not isinstance(calls, list):
        raise bad(where, calls, "must be a list of tool calls", fix)
    out = []
    for i, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if (
            not isinstance(fn, dict)
            or c.get("type", "function") != "function"
            or not isinstance(fn.get("name"), str)
        ):
            raise bad(f"{where}[{i}]", c, "must be a function call with a name", fix)
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            raise bad(f"{where}[{i}].function.arguments", args, "must be a string (JSON text)", fix)
        try:
            parsed = json.loads(args)
        except ValueError:
            parsed = args  # what the model wrote, kept as text
        call = {"type": "function", "function": {"name": fn["name"], "arguments": parsed}}
        if isinstance(c.get("id"), str):
            call["id"] = c["id"]
        out.append(call)
    return out


# ---------------------------------------------------------------------------------------- tools
_CHOICES = ("none", "auto", "required")
_EFFORTS = ("low", "medium", "high")
_FUNCTION_KEYS = ("name", "description", "parameters", "strict")
_TOOL_FIX = (
    'send [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]'
)


def _tools(body: dict[str, Any], gen: Generation) -> None:
    """tools, tool_choice and parallel_tool_calls (chat)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    gen.parallel_tool_calls = (
        True if body.get("parallel_tool_calls") is None else _bool(body, "parallel_tool_calls")
    )
    if tools is None:
        if choice not in (None, "none"):
            raise bad("tool_choice", choice, "needs tools to choose from", "send tools, or omit tool_choice")
        return
    if not isinstance(tools, list) or not tools:
        raise bad("tools", tools, "must be a non-empty list of functions", _TOOL_FIX)
    gen.tools = [_function(f"tools[{i}]", t) for i, t in enumerate(tools)]
    names = [f["name"] for f in gen.tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise bad(
                f"tools[{i}].function.name", name, "names a function twice", "give each function its own name"
            )
    gen.tool_choice, gen.tool_name = _tool_choice(choice, names)
    if gen.tool_choice in ("required", "function") and gen.guide_type is not None:  # _structured's guide
        field = gen.guide_param.split(".")[0]
        raise bad("tool_choice", choice, f"forces a tool call, which the guide of a {gen.guide_type} {field} forbids",
                  f'send tool_choice "auto", or omit {field}')  # fmt: skip


def _function(where: str, tool: Any) -> dict[str, Any]:
    """One offered tool: {"type": "function", "function": {name, description, parameters}}."""
    if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) - {"type", "function"}:
        raise bad(
            where,
            tool,
            'must be {"type": "function", "function": {...}} (only functions are served)',
            _TOOL_FIX,
        )
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise bad(f"{where}.function", fn, "must be an object with name and parameters", _TOOL_FIX)
    for key in fn:
        if key not in _FUNCTION_KEYS:
            raise bad(f"{where}.function.{key}", fn[key], "is not a function field", f"remove {key}")
    name = fn.get("name")
    if (
        not isinstance(name, str)
        or not name
        or len(name) > 64
        or not all(c.isalnum() or c in "_-." for c in name)
    ):
        raise bad(f"{where}.function.name", name, "must be 1 to 64 letters, digits, _, - or .",
                  'send e.g. "get_weather"')  # fmt: skip
    out: dict[str, Any] = {"name": name}
    if fn.get("description") is not None:
        if not isinstance(fn["description"], str):
            raise bad(f"{where}.function.description", fn["description"], "must be a string", "send text")
        out["description"] = fn["description"]
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise bad(f"{where}.function.parameters", params, "must be a JSON schema object",
                  'send e.g. {"type": "object", "properties": {"city": {"type": "string"}}}')  # fmt: skip
    out["parameters"] = params if params is not None else {"type": "object", "properties": {}}
    return out


def _tool_choice(choice: Any, names: list[str]) -> tuple[str, str | None]:
    """("none" | "auto" (the default with tools) | "required", None), or ("function", its name)."""
    if choice is None:
        return "auto", None
    if choice in _CHOICES:
        return str(choice), None
    fix = f'send "none", "auto", "required" or {{"type": "function", "function": {{"name": "{names[0]}"}}}}'
    if (
        not isinstance(choice, dict)
        or choice.get("type") != "function"
        or not isinstance(choice.get("function"), dict)
    ):
        raise bad("tool_choice", choice, "is not a tool choice", fix)
    name = choice["function"].get("name")
    if name not in names:
        raise bad("tool_choice.function.name", name, "names no function in tools",
                  f"send one of {', '.join(names)}")  # fmt: skip
    return "function", name


def _reasoning_effort(body: dict[str, Any], gen: Generation) -> None:
    """reasoning_effort: the chat template's `reasoning_effort` (gpt-oss's template reads it)."""
    effort = body.get("reasoning_effort")
    if effort is None:
        return
    if effort not in _EFFORTS:
        raise bad("reasoning_effort", effort, "is not a reasoning effort", "send low, medium or high")
    kwarg = gen.chat_template_kwargs.get("reasoning_effort", effort)
    if kwarg != effort:
        raise bad("reasoning_effort", effort, f"differs from chat_template_kwargs.reasoning_effort={kwarg!r}",
                  "send only one of the two")  # fmt: skip
    gen.chat_template_kwargs["reasoning_effort"] = effort


class StopHoldback:
    """Streamed text with stop strings: the engine's accumulated text in, safe deltas out.

    The engine cuts the final text at a stop string, but a streamed delta cannot be taken back, so
    the tail of the text that could still become a stop string is held back until the next
    response settles it (vLLM does the same). Feed it the accumulated text of each response.
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.sent = 0

    def delta(self, accumulated: str, *, final: bool) -> str:
        end = len(accumulated) if final else len(accumulated) - self._undecided(accumulated)
        if end <= self.sent:
            return ""
        out = accumulated[self.sent : end]
        self.sent = end
        return out

    def _undecided(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:k]):
                    best = k
                    break
        return best


# ---------------------------------------------------------------------------------------- responses
def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


@dataclass
class Choice:
    """One choice's final state, as the Triton model sent it."""

    text: str = ""
    completion_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[tuple[int, float, tuple[tuple[int, float], ...]]] | None = None


@dataclass
class Outcome:
    """What the Triton model sent for one request (the final state): its n choices."""

    choices: list[Choice] = field(default_factory=lambda: [Choice()])
    prompt_tokens: int | None = None
    cached_tokens: int = 0  # of the prompt tokens, found in the prefix cache
    stats: dict[str, Any] = field(default_factory=dict)
    prompt_ids: list[int] = field(default_factory=list)  # with echo and logprobs: the prompt scored
    prompt_logprobs: list[tuple[int, float, tuple[tuple[int, float], ...]]] | None = None

    def choice(self, index: int) -> Choice:
        while len(self.choices) <= index:
            self.choices.append(Choice())
        return self.choices[index]


def usage(o: Outcome) -> dict[str, Any]:
    """OpenAI's usage: the prompt once (with the tokens the prefix cache held, as OpenAI and vLLM report
    them), the completion tokens of every choice."""
    p = o.prompt_tokens or 0
    c = sum(ch.completion_tokens for ch in o.choices)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": o.cached_tokens}}  # fmt: skip


def dflash_stats(o: Outcome) -> dict[str, Any]:
    """The `dflash` extension object: tau (tokens per round, bonus included), rounds, drafts (of the
    first choice)."""
    s = {k: round(v, 6) if isinstance(v, float) else v for k, v in o.stats.items()}
    return {key: s.get(output) for key, output in DFLASH_STATS.items()}


def finish_reason(value: str | None) -> str | None:
    if value in (None, "", "None"):
        return None
    return value if value in ("stop", "length") else "stop"


def full_response(
    gen: Generation, rid: str, created: int, o: Outcome, token_text: Any = None
) -> dict[str, Any]:
    """token_text(id): a token's text, for log-probabilities."""
    name = token_text or (lambda t: f"token_id:{t}")
    choices = []
    for i, ch in enumerate(o.choices):
        fr = finish_reason(ch.finish_reason) or "stop"
        if gen.echo:
            logprobs = echo_logprobs(gen, o, ch, name) if gen.logprobs is not None else None
            ch = Choice(text=(gen.prompt or "") + ch.text, completion_tokens=ch.completion_tokens)
        else:
            logprobs = logprobs_body(gen, ch.logprobs, name)
        if gen.kind == "chat":
            message, fr = chat_message(gen, ch.text, fr)
            choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": fr})
        else:
            choices.append({"index": i, "text": ch.text, "logprobs": logprobs, "finish_reason": fr})
    return {
        "id": rid,
        "object": "chat.completion" if gen.kind == "chat" else "text_completion",
        "created": created,
        "model": gen.model,
        "choices": choices,
        "usage": usage(o),
        "system_fingerprint": None,
        DFLASH_FIELD: dflash_stats(o),
    }


def chat_message(gen: Generation, text: str, finish: str) -> tuple[dict[str, Any], str]:
    """A chat choice's message ({role, content, refusal}; with a parser also tool_calls and
    reasoning_content) and its finish reason ("tool_calls" when the answer called tools)."""
    parser = gen.parser() if gen.parser is not None else None
    if parser is None:
        return {"role": "assistant", "content": text, "refusal": None}, finish
    parsed = collect(parser, text)
    if parsed.tool_calls and finish == "stop":
        finish = "tool_calls"
    return {"role": "assistant", **parsed.message_fields(reasons=gen.reasons), "refusal": None}, finish


def chunk(
    gen: Generation, rid: str, created: int, *, text: str | None, finish: str | None = None,
    role: bool = False, usage_obj: dict[str, Any] | None = None, stats: dict[str, Any] | None = None,
    no_choice: bool = False, index: int = 0, logprobs: Any = None, reasoning: str | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One streamed chunk of choice `index`. `no_choice`: the final usage-only chunk (choices = []).
    Chat's delta carries `reasoning` as reasoning_content and `tool_calls` (ToolCallDelta.body()s)."""
    obj = "chat.completion.chunk" if gen.kind == "chat" else "text_completion"
    choices: list[dict[str, Any]] = []
    if not no_choice:
        if gen.kind == "chat":
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if reasoning:
                delta["reasoning_content"] = reasoning
            if text is not None:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choices.append({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
        else:
            choices.append(
                {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
            )
    out: dict[str, Any] = {
        "id": rid,
        "object": obj,
        "created": created,
        "model": gen.model,
        "choices": choices,
    }
    if gen.include_usage or gen.continuous_usage:
        out["usage"] = usage_obj
    if stats is not None:
        out[DFLASH_FIELD] = stats
    return out


def now() -> int:
    return int(time.time())
