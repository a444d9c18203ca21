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

import openai
import pytest

from tests.serving.conftest import build_bundle, eventually, grpc_stream_request, launch_serve, metric_value

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


def test_serve_answers_grpc_and_openai_with_ddtree_text_equal_to_generate(tree_served):
    tree = generate_json("--tree-budget", str(BUDGET))
    linear = generate_json()
    assert tree["text"] == linear["text"] and tree["output_ids"] == linear["output_ids"]
    assert tree["tree_budgets"] == [BUDGET] * tree["num_rounds"]
    assert tree["tree_mean_acceptance_length"] == pytest.approx(tree["mean_acceptance_length"])

    last = grpc_stream_request(f"127.0.0.1:{tree_served['grpc']}", PROMPT, MAX_TOKENS)[-1]
    text = last.as_numpy("text_output")[0].decode()
    n_out, tau = int(last.as_numpy("num_output_tokens")[0]), float(last.as_numpy("mean_acceptance_length")[0])
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
