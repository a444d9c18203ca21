# SPDX-License-Identifier: Apache-2.0
"""A DFlash 2 pair through every front, as a user brings it: `dflash-trt build --target tiny --drafter
tiny-dflash2`, a real `dflash-trt serve` (tritonserver + the OpenAI front), queried over gRPC, HTTP and
OpenAI, and swept by `dflash-trt bench sweep`. Greedy text equals `dflash-trt generate --json` with the
same drafter; the selector's overturned drafts are reported per request (the perf outputs, the OpenAI
`dflash` object), as the Prometheus counter and in the sweep's summary. Rounds run eagerly here
(DFLASH_TRT_COMPILE=0, set by tests/conftest.py and inherited by the server)."""

from __future__ import annotations

import contextlib
import io
import json
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from tests.serving.conftest import (
    build_bundle,
    eventually,
    grpc_stream_request,
    http_generate,
    launch_serve,
    pin_full_block,
)

pytestmark = pytest.mark.triton_server

PROMPT = "def fibonacci(n):\n"
MAX_TOKENS = 48
DATASET = Path(__file__).resolve().parents[2] / "bench" / "datasets" / "tiny-python-heldout.jsonl"


class _Server:
    def __init__(self, bundle: Path, proc: subprocess.Popen, ports: dict[str, int]) -> None:
        self.bundle, self.proc, self.ports = bundle, proc, ports
        self.http_url = f"http://127.0.0.1:{ports['http']}"
        self.metrics_url = f"http://127.0.0.1:{ports['metrics']}/metrics"
        self.grpc_url = f"127.0.0.1:{ports['grpc']}"
        self.openai_url = f"http://127.0.0.1:{ports['openai']}"


@pytest.fixture(scope="module")
def served2(tmp_path_factory):
    bundle = build_bundle(tmp_path_factory.mktemp("bundles") / "tiny-dflash2", "--drafter", "tiny-dflash2")
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["drafter"]["architecture"] == "DFlash2DraftModel"
    proc, ports = launch_serve(pin_full_block(bundle), openai=True)  # rounds compared with generate's
    yield _Server(bundle, proc, ports)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err


@pytest.fixture(scope="module")
def reference() -> dict:
    """`dflash-trt generate --json` with the same drafter (embedded engine, greedy, stops at eos like the
    server), in this process."""
    from dflash_trt.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        main(["generate", "--target", "tiny", "--drafter", "tiny-dflash2", "--prompt", PROMPT,
              "--max-new-tokens", str(MAX_TOKENS), "--json"])  # fmt: skip
    assert exit_info.value.code == 0
    ref = json.loads(out.getvalue())
    assert ref["num_overturned_draft_tokens"] > 0, "the trained selector overturned nothing: no teeth"
    return ref


def metric(srv: _Server, name: str) -> float:
    import httpx

    text = httpx.get(srv.metrics_url, timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))  # fmt: skip


def test_grpc_http_and_openai_answer_what_generate_does(served2, reference) -> None:
    """Greedy text over gRPC (streamed), HTTP and OpenAI completions equals `generate --json`; so do the
    rounds and the overturned drafts the server reports, and the Prometheus counter adds them up."""
    before = metric(served2, "dflash_overturned_draft_tokens_total")
    data = grpc_stream_request(served2.grpc_url, PROMPT, MAX_TOKENS)
    final = data[-1]
    assert final.as_numpy("text_output")[0].decode() == reference["text"]
    assert final.as_numpy("num_rounds")[0] == reference["num_rounds"]
    assert final.as_numpy("total_draft_tokens")[0] == reference["num_draft_tokens"]
    assert final.as_numpy("total_overturned_draft_tokens")[0] == reference["num_overturned_draft_tokens"]

    body = {"text_input": PROMPT, "sampling_param_max_tokens": MAX_TOKENS}
    assert http_generate(served2, body).json()["text_output"] == reference["text"]

    with openai.OpenAI(base_url=served2.openai_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == reference["text"]
    stats = r.model_extra["dflash"]
    assert stats["num_rounds"] == reference["num_rounds"]
    assert stats["overturned_draft_tokens"] == reference["num_overturned_draft_tokens"]
    want = before + 3 * reference["num_overturned_draft_tokens"]
    eventually(lambda: metric(served2, "dflash_overturned_draft_tokens_total") == want,
               f"dflash_overturned_draft_tokens_total reaching {want}")  # fmt: skip
    drafted = metric(served2, "dflash_draft_tokens_total")
    assert 0 < metric(served2, "dflash_overturned_draft_tokens_total") <= drafted


def test_bench_sweep_reports_the_overturn_rate(served2, tmp_path) -> None:
    """`dflash-trt bench sweep` over gRPC and OpenAI completions: tau and the selector's pooled overturn
    rate, the same through both protocols at c=1 (greedy, no batching)."""
    points = {}
    for protocol, url, model in (("triton-grpc", served2.grpc_url, "tensorrt_llm"),
                                 ("openai-completions", served2.openai_url, "tiny")):  # fmt: skip
        out = tmp_path / protocol
        proc = subprocess.run(
            [sys.executable, "-m", "dflash_trt", "bench", "sweep", "--url", url, "--protocol", protocol,
             "--model", model, "--tokenizer", "tiny", "--dataset", str(DATASET), "--osl", "24",
             "--concurrency", "1", "--num-requests", "3", "--warmup", "1", "--out", str(out)],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert "overturn " in proc.stderr + proc.stdout  # the point's line shows it
        points[protocol] = json.loads((out / "summary.json").read_text())["points"][0]
    for protocol, p in points.items():
        assert p["num_errors"] == 0, (protocol, p)
        assert p["mean_acceptance_length"] > 1 and 0 < p["overturn_rate_pooled"] < 1, (protocol, p)
    assert points["openai-completions"]["overturn_rate_pooled"] == pytest.approx(
        points["triton-grpc"]["overturn_rate_pooled"]
    )
