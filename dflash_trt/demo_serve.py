# SPDX-License-Identifier: Apache-2.0
"""`make demo`, serving part: build the `tiny` bundle, start a real Triton server on CPU, send a
gRPC streaming request and an HTTP request, print the outputs and DFlash statistics, stop."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PROMPT = "def fibonacci(n):\n"


def main() -> int:
    from dflash_trt.triton.server import TritonServer

    with tempfile.TemporaryDirectory(prefix="dflash-demo-") as tmp:
        bundle = Path(tmp) / "tiny"
        print("$ dflash-trt build --target tiny --output", bundle, flush=True)
        subprocess.run([sys.executable, "-m", "dflash_trt", "build", "--target", "tiny", "--output", str(bundle)],
                       check=True)  # fmt: skip
        # Eager rounds: a demo should answer in seconds; `dflash-trt serve` compiles them by default
        # (minutes the first time on a small CPU, then cached: docs/serving.md).
        print("(the demo serves eager rounds; `dflash-trt serve` compiles them by default)", flush=True)
        server = TritonServer(bundle / "model_repository", http_port=18000, grpc_port=18001, metrics_port=18002,
                              extra_env={"DFLASH_TRT_BUNDLE_ROOT": str(bundle), "DFLASH_TRT_COMPILE": "0"},
                              forward_logs=False)  # fmt: skip
        t0 = time.monotonic()
        server.start()
        try:
            waited = server.wait_ready(180)
            print(f"tritonserver ({server.install.source if server.install else '?'}) ready in {waited:.1f} s: "
                  f"HTTP {server.http_url}, gRPC {server.grpc_url}")  # fmt: skip
            streamed = _grpc_stream(server.grpc_url)
            same = _http_generate(server.http_url, streamed)
            time.sleep(0.5)
            _print_metrics(server.metrics_url)
            return 0 if same else 1
        finally:
            server.stop()
            print(f"\nserver stopped ({time.monotonic() - t0:.1f} s after start)")


def _grpc_stream(url: str) -> str | None:
    """One streaming request over gRPC, as NVIDIA's clients send it; prints the responses' token
    counts and returns the final text (None when nothing arrived)."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    chunks: list[tuple[float, str, int]] = []
    done = threading.Event()

    def callback(result, error):
        if error is not None:
            print("gRPC error:", error)
            done.set()
            return
        if result.as_numpy("text_output") is not None:
            chunks.append((time.monotonic(), result.as_numpy("text_output")[0].decode(),
                           int(result.as_numpy("num_output_tokens")[0])))  # fmt: skip
        if result.get_response().parameters.get("triton_final_response").bool_param:
            done.set()

    def tensor(name, value, dtype, triton):
        t = grpcclient.InferInput(name, [1], triton)
        t.set_data_from_numpy(np.array([value], dtype=dtype))
        return t

    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=callback)
    start = time.monotonic()
    client.async_stream_infer(
        "tensorrt_llm",
        [tensor("text_input", PROMPT.encode(), np.object_, "BYTES"), tensor("streaming", True, np.bool_, "BOOL"),
         tensor("sampling_param_max_tokens", 96, np.int32, "INT32"),
         tensor("sampling_param_return_perf_metrics", True, np.bool_, "BOOL")],
        enable_empty_final_response=True,
    )  # fmt: skip
    done.wait(120)
    client.stop_stream()
    client.close()
    print(f"\ngRPC stream: {len(chunks)} responses; tokens per response: "
          f"{[b - a for (_, _, a), (_, _, b) in zip([(0, '', 0), *chunks], chunks)]}")  # fmt: skip
    if not chunks:
        return None
    print(f"text ({chunks[-1][2]} tokens, first response after {1e3 * (chunks[0][0] - start):.0f} ms):")
    print("    " + repr(chunks[-1][1]))
    return chunks[-1][1]


def _http_generate(url: str, streamed: str | None) -> bool:
    """The same request over HTTP `generate`; whether its text equals the streamed one."""
    import httpx

    body = {"text_input": PROMPT, "sampling_param_max_tokens": 96, "sampling_param_return_perf_metrics": True,
            "return_finish_reason": True}  # fmt: skip
    r = httpx.post(f"{url}/v2/models/tensorrt_llm/generate", json=body, timeout=120).json()
    print(f"\nHTTP generate: finish_reason={r.get('finish_reason')}, tokens={r.get('num_output_tokens')}, "
          f"rounds={r.get('num_rounds')}, mean acceptance length={r.get('mean_acceptance_length', 0):.2f}, "
          f"accepted/drafted={r.get('total_accepted_draft_tokens')}/{r.get('total_draft_tokens')}")  # fmt: skip
    same = streamed is not None and r.get("text_output") == streamed
    print(f"HTTP text == gRPC streamed text: {same}")
    return same


def _print_metrics(url: str) -> None:
    import httpx

    metrics = httpx.get(url, timeout=10).text
    print("\nDFlash metrics:")
    for line in metrics.splitlines():
        if line.startswith(("dflash_rounds_total", "dflash_draft_tokens_total", "dflash_accepted_draft",
                            "dflash_output_tokens_total", "dflash_acceptance_length_sum",
                            "dflash_acceptance_length_count")):  # fmt: skip
            print("    " + line)


if __name__ == "__main__":
    sys.exit(main())
