# SPDX-License-Identifier: Apache-2.0
"""A real tritonserver (CPU, from the nvidia-pytriton wheel) serving the `tiny` bundle through our
Python-backend model: HTTP and gRPC, streaming, metrics, bad requests, cancellation, queueing."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from tests.serving.conftest import (
    build_bundle,
    eventually,
    grpc_stream_request,
    http_generate,
    metric_value,
    start_server,
)

pytestmark = pytest.mark.triton_server

PROMPT = "def fibonacci(n):\n"


def cli_generate(prompt: str, n: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "dflash_trt", "generate", "--target", "tiny", "--prompt", prompt,
         "--max-new-tokens", str(n), "--ignore-eos", "--json"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0, f"generate exited {out.returncode}:\n{out.stderr[-4000:]}"
    return json.loads(out.stdout)


def test_http_generate_equals_cli_generate(server):
    want = cli_generate(PROMPT, 24)
    r = http_generate(server, {"text_input": PROMPT, "sampling_param_max_tokens": 24, "sampling_param_ignore_eos": True,
                               "return_finish_reason": True, "sampling_param_return_perf_metrics": True})  # fmt: skip
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["text_output"] == want["text"]
    assert body["num_output_tokens"] == len(want["output_ids"]) == 24
    assert body["finish_reason"] == "length"
    assert body["num_rounds"] == want["num_rounds"]
    assert body["mean_acceptance_length"] == pytest.approx(want["mean_acceptance_length"])
    assert body["total_draft_tokens"] >= body["total_accepted_draft_tokens"] >= 0
    assert body["first_token_time_ns"] >= body["arrival_time_ns"] > 0


def test_http_stream_accumulated_by_default_and_delta_on_request(server):
    base = {
        "text_input": PROMPT,
        "sampling_param_max_tokens": 20,
        "sampling_param_ignore_eos": True,
        "streaming": True,
    }
    full = http_generate(server, {**base, "streaming": False}).json()["text_output"]
    acc = http_generate(server, base, stream=True)
    assert len(acc) >= 2
    texts = [e["text_output"] for e in acc]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))  # NVIDIA's semantics: accumulated
    assert texts[-1] == full
    counts = [e["num_output_tokens"] for e in acc]
    assert counts == sorted(counts) and counts[-1] == 20
    delta = http_generate(server, {**base, "streaming_delta": True}, stream=True)
    assert "".join(e["text_output"] for e in delta) == full


def test_grpc_streaming_with_tritonclient(server):
    data = grpc_stream_request(server.grpc_url, PROMPT, 16, request_id="g1", ignore_eos=True)
    texts = [r.as_numpy("text_output")[0].decode() for r in data]
    assert texts[-1] == http_generate(server, {"text_input": PROMPT, "sampling_param_max_tokens": 16,
                                               "sampling_param_ignore_eos": True}).json()["text_output"]  # fmt: skip
    assert data[-1].as_numpy("num_output_tokens")[0] == 16
    assert data[-1].as_numpy("mean_acceptance_length")[0] >= 1.0


def test_penalty_bias_and_min_p_inputs_over_http_and_grpc(server):
    """The distribution's inputs (TensorRT-LLM's penalty names, ours for repetition, min_p and the JSON
    logit bias) over HTTP and a gRPC stream: a +100 bias on "x" makes every token "x"."""
    body = {"text_input": PROMPT, "sampling_param_max_tokens": 5, "sampling_param_ignore_eos": True,
            "sampling_param_presence_penalty": 0.5, "sampling_param_frequency_penalty": 0.2,
            "sampling_param_repetition_penalty": 1.2, "sampling_param_min_p": 0.05,
            "sampling_param_logit_bias": json.dumps({"120": 100})}  # fmt: skip
    r = http_generate(server, body)
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == "x" * 5
    inputs = [("text_input", PROMPT.encode(), "BYTES"), ("sampling_param_max_tokens", 5, "INT32"),
              ("sampling_param_ignore_eos", True, "BOOL"), ("streaming", True, "BOOL"),
              ("sampling_param_logit_bias", json.dumps({"120": 100}).encode(), "BYTES"),
              ("sampling_param_repetition_penalty", 1.2, "FP32")]  # fmt: skip
    results = grpc_stream(server, inputs)
    assert results[-1][1] is None and results[-1][0].as_numpy("text_output")[0].decode() == "x" * 5


def test_log_probabilities_over_http(server):
    """sampling_param_logprobs = k: the tokens, their log-probabilities and the k most likely tokens' per
    token; return_cumulative_logprob (NVIDIA's input): their sum."""
    body = {"text_input": PROMPT, "sampling_param_max_tokens": 8, "sampling_param_ignore_eos": True,
            "sampling_param_logprobs": 2, "return_cumulative_logprob": True}  # fmt: skip
    out = http_generate(server, body).json()
    ids, lps = out["output_token_ids"], out["output_log_probs"]
    assert (
        len(ids) == len(lps) == 8
        and len(out["output_top_token_ids"]) == len(out["output_top_log_probs"]) == 16
    )
    assert out["cumulative_logprob"] == pytest.approx(sum(lps), abs=1e-4)
    assert all(lp <= 0 for lp in lps) and out["output_top_log_probs"][0] >= out["output_top_log_probs"][1]
    only_sum = http_generate(server, {k: v for k, v in body.items() if k != "sampling_param_logprobs"}).json()
    assert "output_log_probs" not in only_sum and only_sum["cumulative_logprob"] == pytest.approx(
        out["cumulative_logprob"]
    )


def test_n_sequences_over_http_and_grpc_streaming(server):
    """sampling_param_n: one value per sequence in text_output, num_output_tokens, finish_reason and
    cumulative_logprob; sequence i equals a request seeded sequence_seed(seed, i). Streamed with deltas
    and log-probabilities, output_lengths splits the tokens between the sequences."""
    from dflash_trt.engine.admission import sequence_seed

    base = {"text_input": PROMPT, "sampling_param_max_tokens": 16, "sampling_param_ignore_eos": True,
            "sampling_param_temperature": 1.0, "return_finish_reason": True}  # fmt: skip
    out = http_generate(server, {**base, "sampling_param_n": 3, "sampling_param_seed": 5,
                                 "return_cumulative_logprob": True}).json()  # fmt: skip
    alone = [http_generate(server, {**base, "sampling_param_seed": sequence_seed(5, i)}).json()["text_output"]
             for i in range(3)]  # fmt: skip
    assert out["text_output"] == alone and len(set(alone)) > 1
    assert out["num_output_tokens"] == [16, 16, 16] and out["finish_reason"] == ["length"] * 3
    assert len(out["cumulative_logprob"]) == 3
    inputs = [("text_input", PROMPT.encode(), "BYTES"), ("sampling_param_max_tokens", 16, "INT32"),
              ("sampling_param_ignore_eos", True, "BOOL"), ("streaming", True, "BOOL"),
              ("streaming_delta", True, "BOOL"), ("sampling_param_temperature", 1.0, "FP32"),
              ("sampling_param_n", 2, "INT32"), ("sampling_param_logprobs", 1, "INT32"),
              ("sampling_param_seed", 5, "UINT64")]  # fmt: skip
    results = grpc_stream(server, inputs)
    assert all(err is None for _, err in results)
    texts, ids = ["", ""], [[], []]
    for result, _ in results:
        if result.as_numpy("text_output") is None:
            continue  # the empty final response
        for i, t in enumerate(result.as_numpy("text_output")):
            texts[i] += t.decode()
        lengths, toks = result.as_numpy("output_lengths"), result.as_numpy("output_token_ids").tolist()
        assert lengths is not None and sum(lengths) == len(toks)
        ids[0] += toks[: lengths[0]]
        ids[1] += toks[lengths[0] :]
    assert texts == alone[:2] and [len(x) for x in ids] == [16, 16]


def test_prompt_log_probabilities_over_http(server):
    """sampling_param_prompt_logprobs = k with max_tokens 0: the prompt scored, as the LLM API scores it."""
    from dflash_trt import LLM, SamplingParams

    out = http_generate(server, {"text_input": PROMPT, "sampling_param_max_tokens": 0,
                                 "sampling_param_prompt_logprobs": 2}).json()  # fmt: skip
    with LLM("tiny", max_batch_size=1, compile=False) as llm:
        want = (
            llm.generate(PROMPT, SamplingParams(max_tokens=0, prompt_logprobs=2)).outputs[0].prompt_logprobs
        )
    ids = out["prompt_token_ids"]
    assert out["text_output"] == "" and out["num_output_tokens"] == 0 and len(ids) == len(want)
    assert out["prompt_log_probs"] == pytest.approx(
        [r[t].logprob for t, r in zip(ids[1:], want[1:])], abs=1e-4
    )
    assert len(out["prompt_top_token_ids"]) == len(out["prompt_top_log_probs"]) == 2 * (len(ids) - 1)


def test_bad_words_over_http(server):
    """sampling_param_bad (strings) and sampling_param_bad_token_ids: what the LLM API generates with them."""
    from dflash_trt import LLM, SamplingParams

    prompt = "class Foo:\n    def "  # greedy: "__init__(self, ..."
    body = {"text_input": prompt, "sampling_param_max_tokens": 16, "sampling_param_ignore_eos": True,
            "sampling_param_bad": ["init"], "sampling_param_bad_token_ids": [ord("(")]}  # fmt: skip
    got = http_generate(server, body).json()["text_output"]
    with LLM("tiny", max_batch_size=1, compile=False) as llm:
        want = llm.generate(prompt, SamplingParams(max_tokens=16, ignore_eos=True, bad=["init"],
                                                   bad_token_ids=[ord("(")])).outputs[0].text  # fmt: skip
    assert got == want and "init" not in got and "(" not in got


def test_concurrent_clients(server):
    prompts = [f"x{i} = " for i in range(12)]
    expected = {p: http_generate(server, {"text_input": p, "sampling_param_max_tokens": 12,
                                          "sampling_param_ignore_eos": True}).json()["text_output"] for p in prompts[:3]}  # fmt: skip
    out: dict[str, str] = {}
    errors: list = []

    def worker(p):
        try:
            r = http_generate(
                server, {"text_input": p, "sampling_param_max_tokens": 12, "sampling_param_ignore_eos": True}
            )
            assert r.status_code == 200, r.text
            out[p] = r.json()["text_output"]
        except Exception as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(out) == len(prompts)
    for p, text in expected.items():
        assert out[p] == text  # batching does not change greedy output


@pytest.mark.timing
def test_metrics_endpoint_exposes_dflash_metrics(server):
    """One request's share of each counter, whatever ran on this server before (counters are
    published a flush later, the gauges a stats poll later: both are waited for)."""
    counters = ("dflash_rounds_total", "dflash_acceptance_length_count", "dflash_output_tokens_total",
                "dflash_draft_tokens_total", "dflash_round_duration_seconds_count", "nv_inference_request_success")  # fmt: skip
    before = {name: metric_value(server, name) for name in counters}
    body = {"text_input": PROMPT, "sampling_param_max_tokens": 10, "sampling_param_ignore_eos": True,
            "sampling_param_return_perf_metrics": True}  # fmt: skip
    out = http_generate(server, body).json()
    rounds = out["num_rounds"]
    assert 1 <= rounds <= 10  # at least one token per round

    def added(name: str) -> float:
        return metric_value(server, name) - before[name]

    eventually(lambda: added("dflash_output_tokens_total") == 10, "the request's 10 tokens counted")
    eventually(lambda: added("dflash_rounds_total") == rounds, f"the request's {rounds} rounds counted")
    assert added("dflash_acceptance_length_count") == rounds  # one acceptance length per round
    assert added("dflash_draft_tokens_total") > 0
    assert metric_value(server, "dflash_accepted_draft_tokens_total") >= 0
    eventually(lambda: added("dflash_round_duration_seconds_count") >= 1, "the engine's round times")
    eventually(lambda: added("nv_inference_request_success") >= 1, "Triton's success counter")
    eventually(lambda: metric_value(server, "dflash_requests_active") == 0, "the active gauge back at 0")
    eventually(lambda: metric_value(server, "dflash_requests_queued") == 0, "the queued gauge back at 0")


@pytest.mark.parametrize(
    ("body", "pattern"),
    [
        ({"sampling_param_max_tokens": 4}, "text_input is required"),
        ({"text_input": "x", "sampling_param_max_tokens": 0}, "max_tokens=0 must be an integer >= 1"),
        ({"text_input": "x", "sampling_param_max_tokens": 99999}, "exceeds max_seq_len=2048"),
        ({"text_input": "x", "sampling_param_max_tokens": 4, "foo": 1}, "unknown parameter 'foo'"),
        ({"text_input": "x", "sampling_param_top_p": 1.5}, r"top_p=1.5"),
        (
            {"text_input": "x", "sampling_param_temperature": -1.0},
            "temperature=-1.0: must be a finite number >= 0",
        ),
        ({"text_input": "", "sampling_param_max_tokens": 4}, "text_input is empty"),
        ({"text_input": "x", "sampling_param_logprobs": 21}, "logprobs=21"),
        ({"text_input": "x", "sampling_param_frequency_penalty": 5.0}, "frequency_penalty=5.0"),
        (
            {"text_input": "x", "sampling_param_logit_bias": "[1]"},
            "sampling_param_logit_bias must be a JSON object",
        ),
        ({"text_input": "x", "sampling_param_min_p": -0.5}, "min_p=-0.5"),
    ],
)
def test_bad_requests_get_400_and_the_server_keeps_serving(server, body, pattern):
    r = http_generate(server, body)
    assert r.status_code == 400, r.text
    assert pattern in r.json()["error"]
    ok = http_generate(server, {"text_input": "ok", "sampling_param_max_tokens": 3})
    assert ok.status_code == 200


def grpc_stream(server, inputs: list[tuple[str, object, str]], timeout: float = 60) -> list:
    """Send one request on a gRPC stream; return [(result, error), ...] up to the final response."""
    import tritonclient.grpc as grpcclient

    numpy_types = {
        "BYTES": np.object_,
        "INT32": np.int32,
        "BOOL": np.bool_,
        "FP32": np.float32,
        "UINT64": np.uint64,
    }
    out: list = []
    done = threading.Event()

    def callback(result, error):
        out.append((result, error))
        if error is not None or result.get_response().parameters.get("triton_final_response").bool_param:
            done.set()

    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=callback)
    tensors = []
    for name, value, triton in inputs:
        t = grpcclient.InferInput(name, [1], triton)
        t.set_data_from_numpy(np.array([value], dtype=numpy_types[triton]))
        tensors.append(t)
    client.async_stream_infer("tensorrt_llm", tensors, enable_empty_final_response=True)
    assert done.wait(timeout)
    client.stop_stream()
    client.close()
    return out


def test_wrong_dtypes_and_invalid_utf8(server):
    import httpx

    # a wrong datatype over gRPC: Triton rejects it before the model runs
    out = grpc_stream(server, [("text_input", b"x", "BYTES"), ("sampling_param_max_tokens", 3.0, "FP32")])
    assert out[-1][1] is not None and "data-type is 'FP32', but model 'tensorrt_llm' expects 'INT32'" in str(
        out[-1][1]
    )
    # the generate extension's own JSON conversion: Triton answers an error before the model runs
    r = httpx.post(f"{server.http_url}/v2/models/tensorrt_llm/generate",
                   json={"text_input": "x", "sampling_param_max_tokens": "ten"}, timeout=30)  # fmt: skip
    assert r.status_code >= 400 and "parse" in r.json()["error"].lower()
    # invalid UTF-8 bytes in text_input
    out = grpc_stream(
        server, [("text_input", b"\xff\xfe bad", "BYTES"), ("sampling_param_max_tokens", 3, "INT32")]
    )
    assert out[-1][1] is not None and "not valid UTF-8" in str(out[-1][1])
    assert (
        http_generate(server, {"text_input": "still up", "sampling_param_max_tokens": 3}).status_code == 200
    )


@pytest.mark.timing
def test_client_disconnect_cancels_and_frees_the_slot(server):
    import tritonclient.grpc as grpcclient

    got = threading.Event()

    def callback(result, error):
        got.set()

    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=callback)
    inputs = []
    for name, value, dtype, triton in (("text_input", PROMPT.encode(), np.object_, "BYTES"),
                                       ("streaming", True, np.bool_, "BOOL"),
                                       ("sampling_param_max_tokens", 1900, np.int32, "INT32"),
                                       ("sampling_param_ignore_eos", True, np.bool_, "BOOL")):  # fmt: skip
        t = grpcclient.InferInput(name, [1], triton)
        t.set_data_from_numpy(np.array([value], dtype=dtype))
        inputs.append(t)
    before = metric_value(server, "dflash_output_tokens_total")
    client.async_stream_infer("tensorrt_llm", inputs, request_id="long")
    assert got.wait(60)
    # the gauge is the engine's own count, polled every 0.25 s
    eventually(lambda: metric_value(server, "dflash_requests_active") == 1, "the request counted as active")
    client.stop_stream(cancel_requests=True)  # the client goes away mid-stream
    client.close()
    eventually(lambda: metric_value(server, "dflash_requests_active") == 0, "the slot freed")
    eventually(lambda: metric_value(server, "dflash_kv_cache_utilization") == 0, "the KV pages freed")
    # the request was aborted, not run to its end (ignore_eos: it would have made all 1900 tokens)
    assert metric_value(server, "dflash_output_tokens_total") - before < 1900
    assert http_generate(server, {"text_input": "after", "sampling_param_max_tokens": 3}).status_code == 200


@pytest.mark.slow
def test_burst_beyond_max_batch_size_queues(tmp_path):
    bundle = build_bundle(tmp_path / "b2", "--max-batch-size", "2")
    srv = start_server(bundle / "model_repository", bundle=bundle)
    try:
        results: list = []
        peak = [0.0]
        stop = threading.Event()

        peak_active = [0.0]

        def poll():
            while not stop.is_set():
                peak[0] = max(peak[0], metric_value(srv, "dflash_requests_queued"))
                peak_active[0] = max(peak_active[0], metric_value(srv, "dflash_requests_active"))
                time.sleep(0.05)

        def worker(i):
            # long enough (seconds each) that the queue outlives several of the gauges' 0.25 s polls
            r = http_generate(srv, {"text_input": f"burst {i}", "sampling_param_max_tokens": 600,
                                    "sampling_param_ignore_eos": True}, timeout=300)  # fmt: skip
            results.append(r.status_code)

        poller = threading.Thread(target=poll)
        poller.start()
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        stop.set()
        poller.join()
        assert results == [200] * 6
        assert peak[0] >= 1, "six requests on two slots never queued"
        assert 1 <= peak_active[0] <= 2, "dflash_requests_active counts generating requests, not queued ones"
    finally:
        srv.stop()


@pytest.mark.timing
def test_restart_leaves_no_stray_processes(tiny_bundle, stub_processes, tmp_path):
    import shutil

    bundle = tmp_path / "own"  # a private copy: the session server's stub must not be counted
    shutil.copytree(tiny_bundle, bundle)
    repo = bundle / "model_repository"
    for _ in range(2):
        srv = start_server(repo, bundle=bundle)
        try:
            assert stub_processes(repo), "the Python backend stub should be running"
            assert http_generate(srv, {"text_input": "hi", "sampling_param_max_tokens": 2}).status_code == 200
        finally:
            code = srv.stop()
        assert code == 0
        assert srv.proc is not None and srv.proc.poll() is not None
        eventually(lambda: not stub_processes(repo), "every stub process gone", every=0.2)
