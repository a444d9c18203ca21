# SPDX-License-Identifier: Apache-2.0
"""Decoupled stand-in for the llmapi model: streams a fixed schedule through real Triton.

First chunk (1 token) 40 ms after arrival, then chunks of 4 tokens every 15 ms; a chunk of k tokens
is one round with k - 1 accepted drafts out of 7. Token j is chr(ord('a') + j % 26). Prompts
containing "FAIL" get a Triton error response (to check error handling over both protocols).
"""

import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

TTFT_S, GAP_S, FIRST, PER_CHUNK, DRAFT_LEN = 0.04, 0.015, 1, 4, 7


def _get(request, name, default):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return default if t is None else t.as_numpy().reshape(-1)[0]


def _text(start, count):
    return "".join(chr(97 + j % 26) for j in range(start, start + count))


class TritonPythonModel:
    def initialize(self, args):
        self.threads = []

    def execute(self, requests):
        for request in requests:
            thread = threading.Thread(target=self._serve, args=(request,), daemon=True)
            thread.start()
            self.threads.append(thread)
        self.threads = [t for t in self.threads if t.is_alive()]
        return None

    def _serve(self, request):
        sender = request.get_response_sender()
        arrival_ns = time.monotonic_ns()  # before `arrival`: the server TTFT is never below TTFT_S
        arrival = time.monotonic()
        prompt = _get(request, "text_input", b"")
        prompt = prompt.decode() if isinstance(prompt, bytes) else str(prompt)
        if "FAIL" in prompt:
            sender.send(
                pb_utils.InferenceResponse(error=pb_utils.TritonError("scripted failure")),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
            )
            return
        n = int(_get(request, "sampling_param_max_tokens", 16))
        streaming = bool(_get(request, "streaming", False))
        delta = bool(_get(request, "streaming_delta", False)) and streaming
        perf = bool(_get(request, "sampling_param_return_perf_metrics", False))
        chunks = [min(FIRST, n)]
        while sum(chunks) < n:
            chunks.append(min(PER_CHUNK, n - sum(chunks)))
        first_ns = 0
        for i, k in enumerate(chunks):
            delay = arrival + TTFT_S + i * GAP_S - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            last = i == len(chunks) - 1
            if not streaming and not last:
                continue
            done = sum(chunks[: i + 1])
            now_ns = time.monotonic_ns()
            first_ns = first_ns or now_ns
            start = done - k if delta else 0
            out = [
                pb_utils.Tensor("text_output", np.array([_text(start, done - start).encode()], dtype=object)),
                pb_utils.Tensor("num_output_tokens", np.array([done], dtype=np.int32)),
                pb_utils.Tensor("num_input_tokens", np.array([len(prompt.encode())], dtype=np.int32)),
            ]
            if last and bool(_get(request, "return_finish_reason", False)):
                out.append(pb_utils.Tensor("finish_reason", np.array([b"length"], dtype=object)))
            if perf:
                rounds = i
                accepted = sum(c - 1 for c in chunks[1 : i + 1])
                drafted = rounds * DRAFT_LEN
                out += [
                    pb_utils.Tensor("num_rounds", np.array([rounds], dtype=np.int32)),
                    pb_utils.Tensor("total_accepted_draft_tokens", np.array([accepted], dtype=np.int32)),
                    pb_utils.Tensor("total_draft_tokens", np.array([drafted], dtype=np.int32)),
                    pb_utils.Tensor(
                        "acceptance_rate",
                        np.array([accepted / drafted if drafted else 0.0], dtype=np.float32),
                    ),
                    pb_utils.Tensor("arrival_time_ns", np.array([arrival_ns], dtype=np.int64)),
                    pb_utils.Tensor("first_token_time_ns", np.array([first_ns], dtype=np.int64)),
                    pb_utils.Tensor("last_token_time_ns", np.array([now_ns], dtype=np.int64)),
                ]
                if rounds:
                    out.append(
                        pb_utils.Tensor(
                            "mean_acceptance_length", np.array([1 + accepted / rounds], dtype=np.float32)
                        )
                    )
            flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if last else 0
            sender.send(pb_utils.InferenceResponse(output_tensors=out), flags=flags)

    def finalize(self):
        for t in self.threads:
            t.join(timeout=5)
