# SPDX-License-Identifier: Apache-2.0
"""The OpenAI-compatible front end to end: a real `dflash-trt serve --openai-port` (tritonserver +
the front) driven by the official `openai` client.

Greedy text must equal `dflash-trt generate` for the same prompt (and chat template); token counts
come from the server; every refused field is a 400 in OpenAI's error shape and the server keeps
serving; a client that disconnects aborts its request in the engine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.serving.conftest import eventually, free_ports

pytestmark = pytest.mark.triton_server

PROMPT = "def fibonacci(n):\n"
CHAT = "Write a function that adds two numbers."
MAX_TOKENS = 24
DATASET = Path(__file__).resolve().parents[2] / "bench" / "datasets" / "tiny-python-heldout.jsonl"


class Served:
    def __init__(self, proc: subprocess.Popen, http: int, grpc: int, metrics: int, openai_port: int) -> None:
        self.proc, self.http, self.grpc, self.metrics, self.openai_port = (
            proc,
            http,
            grpc,
            metrics,
            openai_port,
        )
        self.base = f"http://127.0.0.1:{openai_port}"

    def metric(self, name: str) -> float:
        text = httpx.get(f"http://127.0.0.1:{self.metrics}/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") or line.startswith(name + " "))  # fmt: skip


def _wait_health(proc: subprocess.Popen, url: str, timeout: float = 150) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(proc.stderr.read() if proc.stderr else "serve exited")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise AssertionError(f"{url} never answered 200")


def _stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=90)
    return err or ""


@pytest.fixture(scope="module")
def served(pinned_tiny_bundle):
    """`serve` with the OpenAI front, the full block pinned: its tests compare rounds and tau across
    requests and protocols."""
    http, grpc, metrics, oai = free_ports(4)
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash_trt", "serve", "--bundle", str(pinned_tiny_bundle), "--http-port", str(http),
         "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--openai-port", str(oai), "--quiet"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    _wait_health(proc, f"http://127.0.0.1:{oai}/health")
    yield Served(proc, http, grpc, metrics, oai)
    err = _stop(proc)
    assert proc.returncode == 0, err


@pytest.fixture(scope="module")
def client(served):
    with openai.OpenAI(base_url=served.base + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def _generate(*extra: str) -> str:
    """`dflash-trt generate --json` in this process (one torch import, not one per call)."""
    import contextlib
    import io

    from dflash_trt.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        main(["generate", "--target", "tiny", "--max-new-tokens", str(MAX_TOKENS), "--json", *extra])
    assert exit_info.value.code == 0
    return json.loads(out.getvalue())["text"]


@pytest.fixture(scope="module")
def reference_texts() -> dict[str, str]:
    """`dflash-trt generate` for the same prompts: greedy, stops at eos like the server."""
    return {"completions": _generate("--prompt", PROMPT), "chat": _generate("--prompt", CHAT, "--chat")}


def test_models(client) -> None:
    ids = [m.id for m in client.models.list()]
    assert ids == ["tiny"]
    assert client.models.retrieve("tiny").owned_by == "dflash-trt"


def test_completions_greedy_matches_generate(client, reference_texts) -> None:
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == reference_texts["completions"]
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage is not None and r.usage.prompt_tokens == len(PROMPT.encode())  # byte-level tokenizer
    stats = r.model_extra["dflash"]
    assert stats["num_rounds"] >= 1 and 1.0 <= stats["mean_acceptance_length"] <= 16.0
    assert stats["draft_tokens"] >= stats["accepted_draft_tokens"] >= 0

    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == reference_texts["completions"]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.completion_tokens == r.usage.completion_tokens
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].model_extra["dflash"]["num_rounds"] == stats["num_rounds"]


def test_chat_greedy_matches_generate_chat(client, reference_texts) -> None:
    msgs = [{"role": "user", "content": CHAT}]
    r = client.chat.completions.create(
        model="tiny", messages=msgs, max_completion_tokens=MAX_TOKENS, temperature=0
    )
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == reference_texts["chat"]
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=MAX_TOKENS, temperature=0,
                                                 stream=True))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reference_texts["chat"]
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


def test_usage_counts_server_tokens_not_chunks(client) -> None:
    """ignore_eos + min_tokens (extensions): exactly max_tokens; DFlash sends several tokens per chunk."""
    n = 40
    chunks = list(client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=n, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True, "min_tokens": n},
    ))  # fmt: skip
    content = [c for c in chunks if c.choices]
    assert chunks[-1].usage.completion_tokens == n
    assert len(content) < n  # several tokens per chunk: counting chunks would be wrong
    running = [c.usage.completion_tokens for c in content]
    assert running == sorted(running) and running[-1] == n
    stats = content[-1].model_extra["dflash"]  # the first token comes from prefill, each round adds tau
    assert stats["mean_acceptance_length"] == pytest.approx((n - 1) / stats["num_rounds"], rel=1e-4)


def test_stop_strings_and_stop_token_ids(client, reference_texts) -> None:
    ref = reference_texts["completions"]
    stop = ref[5:8]
    r = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=[stop]
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == ref[: ref.index(stop)]
    chunks = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=[stop], stream=True
    )
    assert "".join(c.choices[0].text for c in chunks) == ref[: ref.index(stop)]
    # stop token ids (extension): the byte of the 3rd generated character
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"stop_token_ids": [ord(ref[2])]})  # fmt: skip
    assert r.choices[0].finish_reason == "stop" and len(r.choices[0].text) < len(ref)


def test_seeded_sampling_is_reproducible(client) -> None:
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=16, temperature=1.0, top_p=0.9, seed=7,
              extra_body={"top_k": 20})  # fmt: skip
    a = client.completions.create(**kw).choices[0].text
    assert client.completions.create(**kw).choices[0].text == a


BAD_COMPLETIONS = [
    ({"n": 200}, "n"),  # the front's range
    ({"n": 100}, "n"),  # more than the engine's max_batch_size: the engine's, named through Triton
    ({"n": 2, "best_of": 1}, "best_of"),
    ({"best_of": 3, "stream": True}, "best_of"),  # the best are known only at the end
    ({"logprobs": 9}, "logprobs"),  # completions carry 0..5
    ({"echo": True, "logprobs": 1, "stream": True}, "echo"),  # the prompt's scores are not streamed
    ({"suffix": "x"}, "suffix"),
    ({"presence_penalty": 2.5}, "presence_penalty"),  # the engine's range, named through Triton
    ({"logit_bias": {"x": 1}}, "logit_bias"),  # not a token id: the front's
    ({"logit_bias": {"5000": 1}}, "logit_bias"),  # outside the vocabulary: the engine's
    ({"extra_body": {"min_p": 2}}, "min_p"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 5000}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"seed": -3}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"extra_body": {"top_k": "many"}}, "top_k"),
    ({"extra_body": {"min_tokens": -1}}, "min_tokens"),
    ({"extra_body": {"stop_token_ids": [10**6]}}, "stop_token_ids"),  # outside the vocabulary
    ({"extra_body": {"ignore_eos": "yes"}}, "ignore_eos"),
    ({"extra_body": {"bad_words": "darn"}}, "bad_words"),  # a list of strings
    ({"extra_body": {"stop_token_ids": ["a"]}}, "stop_token_ids"),
    ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": "gpt-4o"}, "model"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, 2, 3]}, "prompt"),
    ({"prompt": ""}, "prompt"),
]
BAD_CHAT = [
    ({"n": 0}, "n"),
    ({"extra_body": {"echo": True}}, "echo"),  # a completions field
    ({"logprobs": "yes"}, "logprobs"),
    ({"top_logprobs": 2, "logprobs": False}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (
        {"tools": [{"type": "function", "function": {"name": "no spaces", "parameters": {}}}]},
        "tools[0].function.name",
    ),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens"),
    ({"max_tokens": None, "max_completion_tokens": 5000}, "max_completion_tokens"),  # the engine's limit
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "critic", "content": "x"}]}, "messages[0].role"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages[0].content[0]",
    ),
    (
        {"extra_body": {"chat_template_kwargs": {"add_generation_prompt": False}}},
        "chat_template_kwargs.add_generation_prompt",
    ),
    (
        {"stream": True, "stream_options": {"include_obfuscation": False}},
        "stream_options.include_obfuscation",
    ),
]


@pytest.mark.parametrize(("kwargs", "param"), BAD_COMPLETIONS, ids=[p for _, p in BAD_COMPLETIONS])
def test_completions_errors_are_400_naming_the_field(client, kwargs, param) -> None:
    body = {"model": "tiny", "prompt": "x", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**body)
    err = info.value.body
    assert info.value.status_code == 400 and err["param"] == param, err
    assert (
        err["type"] == "invalid_request_error"
        and param.split(".")[0] in err["message"]
        and "fix:" in err["message"]
    )


@pytest.mark.parametrize(("kwargs", "param"), BAD_CHAT, ids=[p for _, p in BAD_CHAT])
def test_chat_errors_are_400_naming_the_field(client, kwargs, param) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**body)
    assert info.value.status_code == 400 and info.value.body["param"] == param, info.value.body


def test_penalties_bias_and_min_p_are_served_as_the_llm_api_generates(client) -> None:
    """The distribution's fields through the openai client, both endpoints, equal to the LLM API's
    greedy output for the same prompt and values (DFlash served, plain or DFlash in process alike)."""
    from dflash_trt import LLM, SamplingParams

    fields = {"presence_penalty": 0.8, "frequency_penalty": 0.3}
    extra = {"repetition_penalty": 1.3, "min_p": 0.1}
    with LLM("tiny", max_batch_size=2, compile=False) as llm:
        want = llm.generate(PROMPT, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0,
                                                   **fields, **extra)).outputs[0].text  # fmt: skip
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, **fields,
                                  extra_body={"ignore_eos": True, **extra})  # fmt: skip
    assert r.choices[0].text == want
    x = 120  # the byte tokenizer's id of "x"
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": CHAT}], max_tokens=6,
                                       temperature=0, logit_bias={str(x): 100})  # fmt: skip
    assert r.choices[0].message.content == "x" * 6


def test_logprobs_on_both_endpoints_are_the_llm_apis(client) -> None:
    """Completions' logprobs: k and chat's logprobs with top_logprobs: the served (DFlash) numbers are the
    LLM API's for the same greedy tokens, in OpenAI's shapes."""
    from dflash_trt import LLM, SamplingParams

    with LLM("tiny", max_batch_size=1, compile=False) as llm:
        want = llm.generate(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True, temperature=0, logprobs=3))
    comp = want.outputs[0]
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text == comp.text
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens == 12
    for got, tok, row in zip(lp.token_logprobs, comp.token_ids, comp.logprobs):
        assert abs(got - row[tok].logprob) < 1e-4
    assert all(len(top) == 3 for top in lp.top_logprobs) and lp.text_offset[0] == 0
    c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": CHAT}], max_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=2)  # fmt: skip
    content = c.choices[0].logprobs.content
    assert "".join(e.token for e in content) == c.choices[0].message.content
    assert all(
        len(e.top_logprobs) == 2 and e.logprob <= 0 and e.bytes == list(e.token.encode()) for e in content
    )


def test_n_choices_best_of_and_streamed_logprobs(client) -> None:
    """n choices share one prefill; choice i is the request seeded sequence_seed(seed, i); usage counts
    every choice. best_of returns the most likely of its candidates. Streamed chunks carry their choice's
    index and their tokens' log-probabilities."""
    from dflash_trt.engine.admission import sequence_seed

    kw = dict(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0.9, extra_body={"ignore_eos": True})
    r = client.completions.create(n=3, seed=4, **kw)
    alone = [
        client.completions.create(seed=sequence_seed(4, i), logprobs=0, **kw).choices[0] for i in range(3)
    ]
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [a.text for a in alone] and len({a.text for a in alone}) > 1
    assert r.usage.completion_tokens == 30
    best = client.completions.create(n=1, best_of=3, seed=4, **kw)
    assert best.choices[0].text == max(alone, key=lambda a: sum(a.logprobs.token_logprobs)).text
    chat = dict(model="tiny", messages=[{"role": "user", "content": CHAT}], max_tokens=8, temperature=0.9, seed=2,
                n=2, logprobs=True, top_logprobs=1)  # fmt: skip
    full = client.chat.completions.create(**chat)
    text, tokens = ["", ""], ["", ""]
    for ch in client.chat.completions.create(stream=True, **chat):
        for c in ch.choices:
            text[c.index] += c.delta.content or ""
            tokens[c.index] += "".join(e.token for e in (c.logprobs.content if c.logprobs else []))
    assert text == tokens == [c.message.content for c in full.choices]


def test_bad_words_are_never_generated(client) -> None:
    """vLLM's bad_words: the served text is the LLM API's with `bad` set, and avoids the words."""
    from dflash_trt import LLM, SamplingParams

    prompt = "class Foo:\n    def "  # greedy: "__init__(self, ..."
    kw = dict(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
    free = client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].text
    got = (
        client.completions.create(**kw, extra_body={"ignore_eos": True, "bad_words": ["init"]})
        .choices[0]
        .text
    )
    with LLM("tiny", max_batch_size=1, compile=False) as llm:
        want = llm.generate(
            prompt, SamplingParams(max_tokens=16, ignore_eos=True, temperature=0, bad=["init"])
        )
    assert got == want.outputs[0].text and "init" in free and "init" not in got


def test_echo_scores_the_prompt_as_lm_eval_asks(client) -> None:
    """echo with logprobs and max_tokens 0 (lm-eval's loglikelihood request): the prompt back with its
    tokens' log-probabilities (the first null), the LLM API's; echo with a completion: the prompt, then
    the text a request without echo gets, streamed or not."""
    from dflash_trt import LLM, SamplingParams

    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    with LLM("tiny", max_batch_size=1, compile=False) as llm:
        out = llm.generate(PROMPT, SamplingParams(max_tokens=0, prompt_logprobs=1))
    ids = out.prompt_token_ids
    assert r.choices[0].text == PROMPT == "".join(lp.tokens) and r.usage.completion_tokens == 0
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [row[t].logprob for t, row in zip(ids[1:], out.outputs[0].prompt_logprobs[1:])]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    assert all(len(top) == 1 for top in lp.top_logprobs[1:]) and lp.text_offset[:2] == [0, 1]
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw).choices[0].text
    assert client.completions.create(echo=True, **kw).choices[0].text == PROMPT + plain
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(echo=True, stream=True, **kw) if c.choices
    )
    assert streamed == PROMPT + plain


def test_a_repeated_system_prompt_is_served_from_the_prefix_cache(served, client) -> None:
    """The second chat with the same long system prompt: usage.prompt_tokens_details.cached_tokens counts
    the pages it reused (OpenAI's and vLLM's field), the counters move, and the answer is the same."""
    system = "You are a careful assistant who answers in Python. " * 12
    before = served.metric("dflash_prefix_cache_hits_total")
    kw = dict(model="tiny", max_tokens=8, temperature=0)
    first = client.chat.completions.create(messages=[{"role": "system", "content": system},
                                                     {"role": "user", "content": "Add two numbers."}], **kw)  # fmt: skip
    again = client.chat.completions.create(messages=[{"role": "system", "content": system},
                                                     {"role": "user", "content": "Add two numbers."}], **kw)  # fmt: skip
    assert again.choices[0].message.content == first.choices[0].message.content
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= len(system) - 16 and cached % 16 == 0 and cached < again.usage.prompt_tokens
    eventually(lambda: served.metric("dflash_prefix_cache_hits_total") >= before + cached, "the hit counter")
    assert served.metric("dflash_prefix_cache_queries_total") >= served.metric(
        "dflash_prefix_cache_hits_total"
    )


def test_the_engine_decides_what_values_mean(client) -> None:
    """The front checks the protocol only; values the engine accepts are served as it serves them."""
    r = client.completions.create(model="tiny", prompt="x", max_tokens=4, temperature=2.5, seed=1,
                                  stop=[f"<{i}>" for i in range(17)])  # fmt: skip
    assert r.usage.completion_tokens >= 1
    # min_tokens beyond max_tokens: the length limit wins (the engine's rule)
    r = client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body={"min_tokens": 50})
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length"


def test_raw_http_errors_and_the_server_keeps_serving(served, client) -> None:
    post = lambda path, **kw: httpx.post(served.base + path, timeout=30, **kw)  # noqa: E731
    r = post("/v1/completions", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = post("/v1/completions", json=["a list"])
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    # the model itself refuses a prompt longer than max_seq_len (2048): 400 naming the prompt
    r = post("/v1/completions", json={"model": "tiny", "prompt": "x" * 2100, "max_tokens": 4, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    long_chat = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 2000}]}
    r = post("/v1/chat/completions", json={**long_chat, "max_tokens": 100})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    # no max_tokens: what the context leaves (ignore_eos: at OpenAI's default temperature of 1 a sampled
    # end-of-sequence token would otherwise end it early now and then)
    r = post("/v1/chat/completions", json={**long_chat, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == 2048, r.text
    r = post(
        "/v1/chat/completions", json={**long_chat, "messages": [{"role": "user", "content": "x" * 2100}]}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    r = httpx.get(served.base + "/v1/nothing", timeout=10)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(served.base + "/v1/completions", timeout=10)
    assert r.status_code == 405 and "error" in r.json()
    assert client.completions.create(model="tiny", prompt="x", max_tokens=2).usage.completion_tokens >= 1
    assert httpx.get(served.base + "/health", timeout=10).status_code == 200


def _settled(served, name: str, quiet_s: float = 1.0) -> float:
    """A counter's value once it has stopped moving for `quiet_s`. The model applies counter increments
    from a metrics thread (within POLL_S = 0.25 s, at once when a request ends), so a scrape right after
    the engine's active gauge reads 0 can precede the ended request's last increments."""
    value = served.metric(name)
    for _ in range(30):
        time.sleep(quiet_s)
        now = served.metric(name)
        if now == value:
            return value
        value = now
    raise AssertionError(f"{name} still moving after {30 * quiet_s:g} s")


@pytest.mark.timing
def test_client_disconnect_aborts_the_request(served) -> None:
    n = 1500  # ~5 s of generation on 2 CPU cores
    before = served.metric("dflash_output_tokens_total")
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": n, "temperature": 0, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", served.base + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:"):
                break  # the first chunk arrived: the engine is generating
    # the connection is closed here
    eventually(lambda: served.metric("dflash_requests_active") == 0, "the request aborted", every=0.1)
    # ignore_eos: run to its end, the request would have made all n tokens
    generated = _settled(served, "dflash_output_tokens_total") - before
    assert 0 < generated < n, generated


def test_front_only_mode_fronts_a_running_triton(served, tiny_bundle, reference_texts) -> None:
    """--triton-url: what the Helm chart's sidecar runs (no tritonserver of its own)."""
    (port,) = free_ports(1)
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash_trt", "serve", "--bundle", str(tiny_bundle), "--openai-port", str(port),
         "--triton-url", f"127.0.0.1:{served.grpc}", "--openai-model-name", "tiny-front"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        _wait_health(proc, f"http://127.0.0.1:{port}/health", timeout=60)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": "tiny-front", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0})  # fmt: skip
        assert r.json()["choices"][0]["text"] == reference_texts["completions"]
    finally:
        err = _stop(proc)
    assert proc.returncode == 0 and "stopping the OpenAI front" in err, err


def test_front_without_triton_or_chat_template(tiny_bundle, tmp_path) -> None:
    """/health is 503 and requests are 503 while Triton is unreachable; a tokenizer without a chat
    template makes chat requests a 400 (and the front says so at start)."""
    import shutil

    bundle = tmp_path / "no-template"
    shutil.copytree(tiny_bundle, bundle, symlinks=True)
    (bundle / "engine" / "checkpoints" / "target" / "chat_template.jinja").unlink()
    port, dead = free_ports(2)
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash_trt", "serve", "--bundle", str(bundle), "--openai-port", str(port),
         "--triton-url", f"127.0.0.1:{dead}"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        _wait_health(proc, f"http://127.0.0.1:{port}/health/live", timeout=60)
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 503
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                       json={"model": "tiny", "prompt": "x", "max_tokens": 2})  # fmt: skip
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=30,
                       json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]})  # fmt: skip
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "chat_template_missing" and err["param"] == "messages"
    finally:
        err_text = _stop(proc)
    assert "has no chat template" in err_text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--triton-url", "127.0.0.1:1"], "--triton-url='127.0.0.1:1' needs --openai-port"),
        (["--openai-port", "8000"], "--openai-port=8000 is taken by Triton"),
        (["--openai-model-name", "m"], "--openai-model-name='m' needs --openai-port"),
    ],
)
def test_serve_openai_usage_errors(tiny_bundle, args, message) -> None:
    out = subprocess.run([sys.executable, "-m", "dflash_trt", "serve", "--bundle", str(tiny_bundle), *args],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_port_in_use_is_a_usage_error(tiny_bundle, served) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "dflash_trt", "serve", "--bundle", str(tiny_bundle), "--openai-port",
         str(served.openai_port), "--triton-url", f"127.0.0.1:{served.grpc}"],
        capture_output=True, text=True, timeout=60, env={**os.environ},
    )  # fmt: skip
    assert out.returncode == 2 and f"--openai-port={served.openai_port}: cannot listen" in out.stderr, (
        out.stderr
    )


@pytest.mark.slow
def test_bench_sweep_openai_protocols_agree_with_grpc(served, tmp_path) -> None:
    """`dflash-trt bench sweep --protocol openai-chat / openai-completions` against the front, next to
    the gRPC sweep of the same server: same chat-templated prompts, so at c=1 (greedy, no batching)
    the token counts and tau are identical; tau comes from the `dflash` extension field."""
    summaries = {}
    for protocol, url in (("triton-grpc", f"127.0.0.1:{served.grpc}"), ("openai-chat", served.base),
                          ("openai-completions", served.base)):  # fmt: skip
        model = "tensorrt_llm" if protocol == "triton-grpc" else "tiny"
        out = tmp_path / protocol
        proc = subprocess.run(
            [sys.executable, "-m", "dflash_trt", "bench", "sweep", "--url", url, "--protocol", protocol,
             "--model", model, "--tokenizer", "tiny", "--chat", "--dataset", str(DATASET),
             "--osl", "16", "--concurrency", "1", "--num-requests", "4", "--warmup", "1", "--out", str(out)],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        summaries[protocol] = json.loads((out / "summary.json").read_text())
    points = {p: s["points"][0] for p, s in summaries.items()}
    for protocol, p in points.items():
        assert p["num_errors"] == 0 and p["output_tokens_total"] == 4 * 16, (protocol, p)
        assert p["isl_discrepancy_pct"] == 0.0, protocol  # the front's chat template = the client's
    assert points["openai-chat"]["output_tokens_source"] == "usage"
    tau = {p: pt["mean_acceptance_length"] for p, pt in points.items()}
    assert tau["triton-grpc"] is not None and tau["triton-grpc"] > 1
    assert tau["openai-chat"] == pytest.approx(tau["triton-grpc"], rel=1e-6)
    assert tau["openai-completions"] == pytest.approx(tau["triton-grpc"], rel=1e-6)


@pytest.fixture(scope="module")
def slow_served(tiny_bundle):
    """`serve` with the OpenAI front whose engine steps take 250 ms more (SLOWER_ENGINE): a 1500-token
    request needs at least 94 rounds, 23 s, whatever the machine's load."""
    from tests.serving.conftest import SLOWER_ENGINE

    http, grpc, metrics, oai = free_ports(4)
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash_trt", "serve", "--bundle", str(tiny_bundle), "--http-port", str(http),
         "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--openai-port", str(oai), "--quiet"],
        stderr=subprocess.PIPE, text=True, env={**os.environ, **SLOWER_ENGINE},
    )  # fmt: skip
    _wait_health(proc, f"http://127.0.0.1:{oai}/health")
    yield Served(proc, http, grpc, metrics, oai)
    _stop(proc)


@pytest.mark.timing
def test_non_streaming_disconnect_aborts_too(slow_served) -> None:
    import socket

    served = slow_served
    before = served.metric("dflash_output_tokens_total")
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", served.openai_port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        eventually(lambda: served.metric("dflash_requests_active") == 1, "the request generating")
    eventually(lambda: served.metric("dflash_requests_active") == 0, "the request aborted", every=0.1)
    assert 0 < _settled(served, "dflash_output_tokens_total") - before < 1500  # not run to its end


@pytest.mark.timing
def test_sigterm_lets_in_flight_requests_finish(served, tiny_bundle) -> None:
    """Shutdown stops listening, then waits for in-flight requests (up to 30 s) before exiting."""
    (port,) = free_ports(1)
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash_trt", "serve", "--bundle", str(tiny_bundle), "--openai-port", str(port),
         "--triton-url", f"127.0.0.1:{served.grpc}"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        _wait_health(proc, f"http://127.0.0.1:{port}/health", timeout=60)
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 400, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        events = []
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                if not events:
                    proc.send_signal(signal.SIGTERM)  # mid-request
                events.append(line[5:].strip())
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 400
    finally:
        err = _stop(proc) if proc.poll() is None else proc.communicate(timeout=60)[1]
    assert proc.returncode == 0, err


@pytest.mark.helm
def test_the_charts_helm_test_script_passes_against_the_front(served) -> None:
    """The chart's `helm test` pod for the front (templates/tests/test-openai.yaml), its shell
    script run here with curl against the real front instead of the Service."""
    import shutil

    from dflash_trt.deploy import chart as deploy

    if shutil.which("curl") is None:
        pytest.fail("curl is needed to run the chart's test script")
    chart = Path(__file__).resolve().parents[2] / "helm" / "dflash-trt"
    docs = deploy.render_chart({"openai": {"enabled": True}}, chart_dir=chart).documents
    pod = next(d for d in docs if d["kind"] == "Pod" and d["metadata"]["name"].endswith("test-openai"))
    container = pod["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    env["OPENAI_URL"] = served.base + "/v1"
    run = subprocess.run(
        container["command"], env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert '"completion_tokens"' in run.stdout


# --- structured outputs, served (issue #45) ----------------------------------------------------------
# Prompts no other test of this module sends (no prefix-cache hit changes their prompts' numerics).
GUIDED_CASES = [  # (prompt, request fields, a check of the answer)
    ("# Settings for the parser, as JSON:\n",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "cfg", "strict": True, "schema": {
         "type": "object", "properties": {"name": {"type": "string", "maxLength": 16}, "depth": {"type": "integer",
         "minimum": 0, "maximum": 99}}, "required": ["name", "depth"], "additionalProperties": False}}}},
     lambda t: set(json.loads(t)) == {"name", "depth"}),
    ("# A Python keyword that starts a loop: ",
     {"structured_outputs": {"choice": ["for", "while", "with"]}}, lambda t: t in ("for", "while", "with")),
    ("# The signature of the helper:\n",
     {"structured_outputs": {"regex": r"def [a-z_]{1,12}\(self\):"}},
     lambda t: t.startswith("def ") and t.endswith("(self):")),
    ("# A JSON object describing a file:\n", {"response_format": {"type": "json_object"}},
     lambda t: isinstance(json.loads(t), dict)),
]  # fmt: skip


def _plain_guided(prompt: str, guide: tuple[str, str]) -> str:
    """Greedy plain decoding (no drafter) in this process under the same guide."""
    from dflash_trt import LLM, GuidedDecodingParams, SamplingParams

    kind, text = guide
    field = {"json_schema": "json", "regex": "regex", "ebnf_grammar": "grammar"}[kind]
    with LLM("tiny", compile=False, guided_decoding_backend="xgrammar") as llm:
        sp = SamplingParams(
            max_tokens=64, temperature=0, guided_decoding=GuidedDecodingParams(**{field: text})
        )
        return llm.generate(prompt, sp).outputs[0].text


@pytest.mark.parametrize("case", range(len(GUIDED_CASES)))
def test_structured_outputs_served_equal_plain_guided_decoding(client, case) -> None:
    from dflash_trt.openai_front import protocol as P

    prompt, fields, check = GUIDED_CASES[case]  # the completions SDK call takes them as extra_body
    r = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=64, temperature=0, extra_body=fields
    )
    text = r.choices[0].text
    assert r.choices[0].finish_reason == "stop" and check(text), text
    gen = P.parse_completions({"model": "tiny", "prompt": prompt, **fields}, ["tiny"])  # the guide it sent
    assert text == _plain_guided(prompt, (gen.guide_type, gen.guide))
    assert r.model_extra["dflash"]["num_rounds"] >= 1
    chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=64, temperature=0, stream=True,
                                       extra_body=fields)  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text


def test_a_required_tool_call_on_tiny(client) -> None:
    """tiny's plain ChatML template: the front describes the tool in the system message and the guide
    forces one Hermes call whose arguments validate, whole and streamed alike."""
    tool = {"type": "function", "function": {"name": "read_file", "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string", "maxLength": 24}},
                           "required": ["path"], "additionalProperties": False}}}  # fmt: skip
    kw = {"model": "tiny", "messages": [{"role": "user", "content": "Open setup.py"}], "tools": [tool],
          "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0, "max_tokens": 96}  # fmt: skip
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
    call = choice.message.tool_calls[0]
    assert call.function.name == "read_file" and set(json.loads(call.function.arguments)) == {"path"}
    streamed = [t for c in client.chat.completions.create(**kw, stream=True) if c.choices
                for t in c.choices[0].delta.tool_calls or []]  # fmt: skip
    assert streamed[0].function.name == "read_file"
    assert json.loads("".join(t.function.arguments or "" for t in streamed)) == json.loads(
        call.function.arguments
    )
