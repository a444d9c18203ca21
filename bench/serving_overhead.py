# SPDX-License-Identifier: Apache-2.0
"""Serving overhead: requests/s of a bundle through a real Triton server vs the same engine
in-process, at a fixed concurrency, plus the server's start time.

    .venv/bin/python bench/serving_overhead.py --target tiny --concurrency 8 --requests 64 --max-tokens 64

Both sides run the same requests (greedy, ignore_eos, fixed output length) from `concurrency`
closed-loop workers. In-process: threads calling LLM.generate. Triton: the same number of HTTP
clients calling /generate (non-streaming, pooled connections) and, separately, gRPC streaming clients,
each keeping one channel and one stream across its requests (as the OpenAI front does; until
2026-11-28 each request opened a channel of its own, which measured the client's connection set-up
as overhead: 24.5 % at c=8 that way, bench/README.md). The three phases
alternate, `--repeats` times, with the in-process engine and the server both up; overhead = 1 -
triton_rps / inprocess_rps within each repeat, and the medians are the headline. Prints its
configuration next to its numbers. `--engine-in-stub` serves with the engine on a thread of the
Triton stub (triton_config.engine_process: false), to compare with the default layout, the engine in
a process of its own.
"""

from __future__ import annotations

import argparse
import json
import platform
import queue
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path


def closed_loop(n_requests: int, concurrency: int, fn) -> float:
    """Run fn(i) for i < n_requests from `concurrency` workers; return wall seconds."""
    lock = threading.Lock()
    nxt = [0]
    errors: list[BaseException] = []

    def worker() -> None:
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= n_requests:
                return
            try:
                fn(i)
            except BaseException as exc:
                errors.append(exc)
                return

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="tiny")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--no-draft", action="store_true")
    ap.add_argument("--engine-in-stub", action="store_true",
                    help="serve with triton_config.engine_process: false (the engine on a thread of the "
                         "Triton stub) instead of the default, the engine in a process of its own")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=3,
                    help="rounds of the three phases (in process, HTTP, gRPC), interleaved (default 3)")  # fmt: skip
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: must be >= 1")

    import httpx
    import numpy as np
    import torch
    import tritonclient.grpc as grpcclient
    import yaml

    from dflash_trt import LLM, SamplingParams, __version__
    from dflash_trt.triton.server import TritonServer

    prompts = [f"def function_{i}(x):\n    " for i in range(args.requests)]
    with tempfile.TemporaryDirectory() as tmp:
        bundle = Path(tmp) / "b"
        import subprocess

        subprocess.run([sys.executable, "-m", "dflash_trt", "build", "--target", args.target, "--output", str(bundle)],
                       check=True, capture_output=True)  # fmt: skip
        llm_args = yaml.safe_load((bundle / "engine/llm_api.yaml").read_text())
        for key in ("model", "tokenizer"):
            llm_args[key] = str(bundle / llm_args[key])
        spec = llm_args.pop("speculative_config")
        if not args.no_draft:
            spec["speculative_model"] = str(bundle / spec["speculative_model"])
            llm_args["speculative_config"] = spec

        if args.engine_in_stub:
            model_yaml = bundle / "model_repository/tensorrt_llm/1/model.yaml"
            cfg = yaml.safe_load(model_yaml.read_text())
            cfg["triton_config"]["engine_process"] = False
            model_yaml.write_text(yaml.safe_dump(cfg, sort_keys=False))

        # in process: the same engine, alive next to the server, so that the phases can alternate
        llm = LLM(**llm_args)
        sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        llm.generate(prompts[:2], sp)  # warm-up

        # Triton
        repo = bundle / "model_repository"
        if args.no_draft:
            from dflash_trt.cli.serve import _without_drafter

            repo = _without_drafter(repo, Path(tmp) / "nd")
        srv = TritonServer(repo, http_port=18100, grpc_port=18101, metrics_port=18102,
                           extra_env={"DFLASH_TRT_BUNDLE_ROOT": str(bundle)}, forward_logs=False)  # fmt: skip
        t0 = time.perf_counter()
        srv.start()
        try:
            ready_s = srv.wait_ready(300)
            start_s = time.perf_counter() - t0
            client = httpx.Client(timeout=300)
            url = f"{srv.http_url}/v2/models/tensorrt_llm/generate"

            def http_req(i: int) -> None:
                r = client.post(url, json={"text_input": prompts[i], "sampling_param_max_tokens": args.max_tokens,
                                           "sampling_param_ignore_eos": True})  # fmt: skip
                r.raise_for_status()

            http_req(0)

            class Stream:
                """One gRPC channel and bidirectional stream, kept across requests (one request at a time),
                as the OpenAI front and any long-lived client keep them."""

                def __init__(self) -> None:
                    self.client = grpcclient.InferenceServerClient(srv.grpc_url)
                    self.done = threading.Event()
                    self.err: list = []
                    self.client.start_stream(callback=self._on_response)

                def _on_response(self, result, error) -> None:
                    if error is not None:
                        self.err.append(error)
                        self.done.set()
                    elif result.get_response().parameters.get("triton_final_response").bool_param:
                        self.done.set()

                def close(self) -> None:
                    self.client.stop_stream()
                    self.client.close()

            streams: queue.Queue[Stream] = queue.Queue()
            for _ in range(args.concurrency):
                streams.put(Stream())

            def grpc_req(i: int) -> None:
                stream = streams.get()
                try:
                    stream.done.clear()
                    ins = []
                    for name, val, dt, tt in (("text_input", prompts[i].encode(), np.object_, "BYTES"),
                                              ("streaming", True, np.bool_, "BOOL"),
                                              ("sampling_param_max_tokens", args.max_tokens, np.int32, "INT32"),
                                              ("sampling_param_ignore_eos", True, np.bool_, "BOOL")):  # fmt: skip
                        t = grpcclient.InferInput(name, [1], tt)
                        t.set_data_from_numpy(np.array([val], dtype=dt))
                        ins.append(t)
                    stream.client.async_stream_infer("tensorrt_llm", ins, enable_empty_final_response=True)
                    if not stream.done.wait(300):
                        raise TimeoutError(f"gRPC request {i}: no final response within 300 s")
                    if stream.err:
                        raise RuntimeError(stream.err[0])
                finally:
                    streams.put(stream)

            # The phases alternate, each run `repeats` times: this host's speed moves by ~20 % within a
            # minute, and run one after the other the three phases measured that swing as overhead.
            times: dict[str, list[float]] = {"inprocess": [], "http": [], "grpc": []}
            phases = {"inprocess": lambda i: llm.generate(prompts[i], sp), "http": http_req, "grpc": grpc_req}
            for _ in range(args.repeats):
                for name, fn in phases.items():
                    times[name].append(closed_loop(args.requests, args.concurrency, fn))
            while not streams.empty():
                streams.get().close()
        finally:
            srv.stop()
            llm.shutdown()

    result = {
        "config": {
            "target": args.target,
            "drafter": not args.no_draft,
            "engine_process": not args.engine_in_stub,
            "concurrency": args.concurrency,
            "requests": args.requests,
            "max_tokens": args.max_tokens,
            "greedy": True,
            "machine": platform.machine(),
            "cpu_threads": torch.get_num_threads(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "dflash_trt": __version__,
            "date": time.strftime("%Y-%m-%d"),
        },
        "server_ready_s": round(ready_s, 2),
        "server_start_to_ready_s": round(start_s, 2),
        "repeats": args.repeats,
        # per repeat: requests/s of each phase, and each Triton phase's overhead against the in-process
        # phase of the same repeat; the headline numbers are their medians
        "inprocess_rps_each": [round(args.requests / t, 2) for t in times["inprocess"]],
        "triton_http_rps_each": [round(args.requests / t, 2) for t in times["http"]],
        "triton_grpc_stream_rps_each": [round(args.requests / t, 2) for t in times["grpc"]],
        "overhead_http_each": [
            round(1 - a / b, 4) for a, b in zip(times["inprocess"], times["http"], strict=True)
        ],
        "overhead_grpc_stream_each": [
            round(1 - a / b, 4) for a, b in zip(times["inprocess"], times["grpc"], strict=True)
        ],
    }
    for key in (
        "inprocess_rps",
        "triton_http_rps",
        "triton_grpc_stream_rps",
        "overhead_http",
        "overhead_grpc_stream",
    ):
        result[key] = round(statistics.median(result[f"{key}_each"]), 4)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
