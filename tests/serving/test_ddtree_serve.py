# SPDX-License-Identifier: Apache-2.0
"""DDTree served end to end: a real `dflash-trt serve` of a tiny bundle built with --tree-budget
answers gRPC (tritonclient, streaming) and OpenAI requests with the text `dflash-trt generate --json
--tree-budget` gives (itself equal to linear DFlash's: greedy is lossless), and exposes the chosen
budget and the tree rounds' acceptance in its Prometheus metrics. Eager rounds (the suite's
DFLASH_TRT_COMPILE=0) keep it quick."""

from __future__ import annotations

import contextlib
import io
import json
import signal
import threading

import numpy as np
import openai
import pytest

from tests.serving.conftest import build_bundle, eventually, launch_serve, metric_value

pytestmark = pytest.mark.triton_server

PROMPT = "def fibonacci(n):\n"
MAX_TOKENS = 40
BUDGET = 32


def generate_json(*extra: str) -> dict:
    """`dflash-trt generate --json` (embedded engine) in this process."""
    from dflash_trt.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        main(["generate", "--target", "tiny", "--prompt", PROMPT, "--max-new-tokens", str(MAX_TOKENS), "--json",
              "--engine", "embedded", *extra])  # fmt: skip
    assert exit_info.value.code == 0
    return json.loads(out.getvalue())


class _Metrics:
    def __init__(self, port: int) -> None:
        self.metrics_url = f"http://127.0.0.1:{port}/metrics"


@pytest.fixture(scope="module")
def tree_served(tmp_path_factory):
    bundle = build_bundle(tmp_path_factory.mktemp("ddtree") / "bundle", "--tree-budget", str(BUDGET))
    proc, ports = launch_serve(bundle, openai=True)
    yield ports
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err


def grpc_stream(port: int, prompt: str, max_tokens: int) -> tuple[str, int, float]:
    """One streaming gRPC request: (final text, output tokens, mean acceptance length)."""
    import tritonclient.grpc as grpcclient

    results: list = []
    done = threading.Event()

    def callback(result, error):
        results.append((result, error))
        if error is not None or result.get_response().parameters.get("triton_final_response").bool_param:
            done.set()

    def tensor(name, value, dtype, kind):
        arr = np.array([value], dtype=dtype)
        t = grpcclient.InferInput(name, list(arr.shape), kind)
        t.set_data_from_numpy(arr)
        return t

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    client.start_stream(callback=callback)
    inputs = [
        tensor("text_input", prompt.encode(), np.object_, "BYTES"),
        tensor("streaming", True, np.bool_, "BOOL"),
        tensor("sampling_param_max_tokens", max_tokens, np.int32, "INT32"),
        tensor("sampling_param_return_perf_metrics", True, np.bool_, "BOOL"),
    ]
    client.async_stream_infer("tensorrt_llm", inputs, request_id="t1", enable_empty_final_response=True)
    assert done.wait(120)
    client.stop_stream()
    client.close()
    assert all(err is None for _, err in results), results
    data = [r for r, _ in results if r.as_numpy("text_output") is not None]
    last = data[-1]
    return (
        last.as_numpy("text_output")[0].decode(),
        int(last.as_numpy("num_output_tokens")[0]),
        float(last.as_numpy("mean_acceptance_length")[0]),
    )


def test_serve_answers_grpc_and_openai_with_ddtree_text_equal_to_generate(tree_served):
    tree = generate_json("--tree-budget", str(BUDGET))
    linear = generate_json()
    assert tree["text"] == linear["text"] and tree["output_ids"] == linear["output_ids"]
    assert tree["tree_budgets"] == [BUDGET] * tree["num_rounds"]
    assert tree["tree_mean_acceptance_length"] == pytest.approx(tree["mean_acceptance_length"])

    text, n_out, tau = grpc_stream(tree_served["grpc"], PROMPT, MAX_TOKENS)
    assert text == tree["text"] and n_out == len(tree["output_ids"])
    assert tau == pytest.approx(tree["mean_acceptance_length"], rel=1e-5)

    base = f"http://127.0.0.1:{tree_served['openai']}/v1"
    with openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120) as client:
        r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].text == tree["text"]
        chunks = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True)  # fmt: skip
        assert "".join(c.choices[0].text for c in chunks if c.choices) == tree["text"]
    assert r.model_extra["dflash"]["num_rounds"] == tree["num_rounds"]

    served = _Metrics(tree_served["metrics"])
    rounds = 3 * tree["num_rounds"]  # the gRPC request and the two OpenAI ones, all tree rounds
    eventually(
        lambda: metric_value(served, "dflash_tree_acceptance_length_count") >= rounds, "tree rounds counted"
    )
    assert metric_value(served, "dflash_tree_acceptance_length_count") == rounds
    assert metric_value(served, "dflash_tree_acceptance_length_sum") == 3 * sum(tree["acceptance_lengths"])
    eventually(lambda: metric_value(served, "dflash_tree_budget") == BUDGET, "the budget gauge")
