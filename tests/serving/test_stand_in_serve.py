# SPDX-License-Identifier: Apache-2.0
"""The stand-in engine (engine/stand_in.py) under `dflash-trt serve`: K tokens per round reach the
client through every hop (the engine process, the Triton stub, tritonserver, the OpenAI front), over
Triton HTTP, Triton gRPC and the OpenAI front, with the DFlash statistics of K - 1 accepted drafts per
round. A stream may merge rounds that reach the stub together, so each response holds the prefill's
token plus whole rounds: every cumulative count is 1 mod K.

The stub and the engine process import the dflash_trt installed in the interpreter (the Python backend
ignores PYTHONPATH): run from a checkout installed in it."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.serving.conftest import build_bundle, grpc_stream_request, launch_serve

pytestmark = pytest.mark.triton_server

K = 4
MAX_TOKENS = 1 + 6 * K  # the prefill's token, then six rounds of K
PROMPT = "def f(x):\n"


@pytest.fixture(scope="module")
def stand_in_served(tmp_path_factory):
    bundle = build_bundle(tmp_path_factory.mktemp("stand-in") / "tiny")
    env = {"DFLASH_TRT_TESTING": "1", "DFLASH_TRT_STAND_IN": f"{K}:20"}
    proc, ports = launch_serve(bundle, "--eager", openai=True, env=env)
    yield ports
    proc.terminate()
    proc.communicate(timeout=60)


def _rounds_of_k(counts: list[int]) -> bool:
    return bool(counts) and counts[-1] == MAX_TOKENS and all(c % K == 1 for c in counts)


def test_triton_http_stream_gets_k_tokens_per_round(stand_in_served):
    body = {"text_input": PROMPT, "sampling_param_max_tokens": MAX_TOKENS, "sampling_param_ignore_eos": True,
            "streaming": True, "streaming_delta": True, "sampling_param_return_perf_metrics": True}  # fmt: skip
    url = f"http://127.0.0.1:{stand_in_served['http']}/v2/models/tensorrt_llm/generate_stream"
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    counts = [e["num_output_tokens"] for e in events]
    assert _rounds_of_k(counts), counts
    assert len("".join(e["text_output"] for e in events)) == MAX_TOKENS  # one printable byte per token
    last = events[-1]
    assert last["mean_acceptance_length"] == K and last["acceptance_rate"] == 1.0
    assert last["total_draft_tokens"] == last["total_accepted_draft_tokens"] == 6 * (K - 1)


def test_triton_grpc_stream_gets_k_tokens_per_round(stand_in_served):
    data = grpc_stream_request(f"127.0.0.1:{stand_in_served['grpc']}", PROMPT, MAX_TOKENS, ignore_eos=True)
    counts = [int(r.as_numpy("num_output_tokens")[0]) for r in data]
    assert _rounds_of_k(counts), counts
    assert len(data[-1].as_numpy("text_output")[0].decode()) == MAX_TOKENS
    assert data[-1].as_numpy("mean_acceptance_length")[0] == K


def test_openai_stream_gets_k_tokens_per_round(stand_in_served):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    url = f"http://127.0.0.1:{stand_in_served['openai']}/v1/completions"
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[5:]) for line in r.iter_lines()
                  if line.startswith("data:") and line[5:].strip() != "[DONE]"]  # fmt: skip
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert _rounds_of_k(counts), counts
    assert len("".join(texts)) == MAX_TOKENS
    assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
