# SPDX-License-Identifier: Apache-2.0
"""The Triton side of the front: `ModelStreamInfer` streams through tritonclient's aio gRPC client.

A stream carries one request at a time and is reused by the next request once the response whose
`triton_final_response` parameter is true has arrived (a new RPC per request cost the front ~3 ms
of CPU). Cancelling a stream (the HTTP client went away mid-request) cancels its request in
Triton; the model sees `is_cancelled()` and aborts the generation, freeing its slot and KV pages.
Streams whose request has finished are never cancelled, only half-closed: cancelling a finished
stream kept Triton 2.51 from unloading the model at shutdown (its exit timeout expired).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio

from dflash_trt.openai_front.protocol import DFLASH_STATS, Generation, OpenAIError, scores_prompt
from dflash_trt.triton.kserve import decode_raw, parse_model_error
from dflash_trt.utils.api_key import ApiKey

# Speculative statistics read from the final response.
STATS_OUTPUTS = tuple(DFLASH_STATS.values())
# HTTP/2 servers commonly cap concurrent streams per connection at 100; stay below.
STREAMS_PER_CHANNEL = 64
# How Triton refuses a request without the key of a restricted protocol (gRPC status UNAVAILABLE).
RESTRICTED = "This protocol is restricted"


LogprobRow = tuple[int, float, tuple[tuple[int, float], ...]]  # (token id, log-probability, alternatives)


@dataclass
class Seq:
    """One sequence (choice) of a Triton response."""

    text: str
    completion_tokens: int | None
    finish_reason: str | None
    # with logprobs: per token of this response, (token id, log-probability, ((id, log-probability), ...))
    logprobs: list[LogprobRow] | None = None


@dataclass
class Piece:
    """One Triton response, as the front needs it: every sequence's news (n of them with n > 1)."""

    seqs: list[Seq]
    prompt_tokens: int | None
    final: bool
    cached_tokens: int | None = None  # of the prompt's, found in the prefix cache
    stats: dict[str, Any] = field(default_factory=dict)
    prompt_ids: list[int] = field(default_factory=list)  # with prompt log-probabilities (final only)
    prompt_logprobs: list[LogprobRow] | None = None  # per prompt token after the first


def _values(response: Any) -> dict[str, list[Any]]:
    """name -> the elements of every output of a ModelInferResponse, read from the raw contents
    (struct unpacks: cheaper than tritonclient's numpy deserialisation per chunk)."""
    raws = response.raw_output_contents
    out: dict[str, list[Any]] = {}
    for i, o in enumerate(response.outputs):
        values = decode_raw(o.datatype, raws[i] if i < len(raws) else b"")
        out[o.name] = [v.decode("utf-8", errors="replace") if isinstance(v, bytes) else v for v in values]
    return out


def model_error(text: str, gen: Generation) -> OpenAIError:
    """What the model (or Triton) answered instead of a response, read from the error trailer the
    model puts on every error (kserve.parse_model_error): a refused request is a 400 whose `param`
    is the field the model named; a draining model a 503; any other failure a 500."""
    err = parse_model_error(text)
    if err.kind == "UNAVAILABLE":
        return OpenAIError(f"the model is unavailable: {err.message}", status=503, type="server_error")
    if err.kind not in (None, "INVALID_ARG"):  # Triton's own errors carry no trailer: bad requests
        return OpenAIError(f"the model failed: {err.message}", status=500, type="server_error")
    return OpenAIError(err.message, param=_param(err.field, gen))


def _param(field: str | None, gen: Generation) -> str | None:
    """The OpenAI request field behind a field the model named (an input name or an engine field)."""
    if field is None:
        return None
    name = field.removeprefix("sampling_param_")
    if name in ("prompt", "text_input"):
        return "messages" if gen.kind == "chat" else "prompt"
    if name == "max_tokens":
        return gen.max_tokens_param
    if name in ("guided_decoding", "guided_decoding_guide", "guided_decoding_guide_type"):
        return gen.guide_param  # the engine's field, or the model's inputs: the client's guide field
    return name


class _Stream:
    """A long-lived `ModelStreamInfer` stream carrying one request at a time.

    A finished request leaves its stream open for the next one (one message per request instead of
    a new RPC). Requests never overlap on a stream, so every response belongs to the request in
    flight; a request abandoned mid-way cancels its stream, which cancels the request in Triton.
    """

    def __init__(self, client: Any, slot: int, headers: dict[str, str] | None) -> None:
        self.slot = slot
        self._queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self.call = client.stream_infer(self._requests(), headers=headers)

    async def _requests(self) -> AsyncIterator[dict[str, Any]]:
        while True:
            item = await self._queue.get()
            if item is None:
                return
            yield item

    def send(self, request: dict[str, Any]) -> None:
        self._queue.put_nowait(request)

    async def read(self) -> tuple[Any, Any]:
        return await self.call.__anext__()

    def end(self) -> None:
        """Half-close: Triton ends the stream once nothing is in flight (no cancellation)."""
        self._queue.put_nowait(None)


class Upstream:
    def __init__(self, url: str, model_name: str, *, api_key: ApiKey | None = None) -> None:
        self.url = url
        self.model_name = model_name
        # gRPC metadata for Triton's restricted protocols (health needs none)
        self._headers = dict(api_key.grpc_metadata()) if api_key is not None else None
        self._clients: list[Any] = []
        self._streams: list[int] = []  # open streams (busy + idle) per client
        self._idle: list[_Stream] = []

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for stream in idle:
            stream.end()
        if idle:  # let Triton close them (finished streams are never cancelled: see the module doc)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    asyncio.gather(*(self._drain(s) for s in idle), return_exceptions=True), 5
                )
        for c in self._clients:
            await c.close()
        self._clients.clear()
        self._streams.clear()

    @staticmethod
    async def _drain(stream: _Stream) -> None:
        with contextlib.suppress(StopAsyncIteration):
            while True:
                await stream.read()

    def _client(self) -> int:
        """The client (one gRPC channel each) with the fewest open streams; a new one when all
        are at STREAMS_PER_CHANNEL."""
        if not self._clients or min(self._streams) >= STREAMS_PER_CHANNEL:
            self._clients.append(grpcaio.InferenceServerClient(self.url))
            self._streams.append(0)
        return min(range(len(self._clients)), key=self._streams.__getitem__)

    def _acquire(self) -> _Stream:
        if self._idle:
            return self._idle.pop()
        i = self._client()
        self._streams[i] += 1
        return _Stream(self._clients[i], i, self._headers)

    def _release(self, stream: _Stream, *, reusable: bool) -> None:
        if reusable and stream.slot < len(self._clients):
            self._idle.append(stream)
            return
        if stream.slot < len(self._streams):
            self._streams[stream.slot] -= 1

    async def ready(self) -> bool:
        """Triton is up and the model is ready."""
        try:
            c = self._clients[self._client()]
            return bool(await c.is_server_ready()) and bool(await c.is_model_ready(self.model_name))
        except Exception:
            return False

    def _inputs(self, gen: Generation) -> list[Any]:
        """The request as the Triton model's input tensors."""
        inputs = []
        for name, dtype, data in [*_core_values(gen), *_sampling_values(gen)]:
            inp = grpcclient.InferInput(name, [len(data)], dtype)
            inp.set_data_from_numpy(np.array(data, dtype=_DTYPES[dtype]))
            inputs.append(inp)
        return inputs

    async def generate(self, gen: Generation, request_id: str) -> AsyncGenerator[Piece, None]:
        """Responses of one request; raises OpenAIError when Triton or the model refuses it.

        Leaving the iteration early (or cancelling the task) cancels the request in Triton. A
        reused stream that turns out dead (Triton restarted) is retried once on a new one.
        """
        inputs = self._inputs(gen)
        request = {"model_name": self.model_name, "inputs": inputs, "request_id": request_id}
        for attempt in (0, 1):
            reused = bool(self._idle)
            stream = self._acquire()
            reusable = finished = produced = False
            try:
                stream.send(request)
                while True:
                    result, error = await stream.read()
                    if error is not None:
                        finished = True  # Triton's error response is the request's last
                        raise _refusal(error, gen, produced=produced)
                    piece = _piece(result.get_response())
                    produced = True
                    if piece.final:
                        finished = reusable = True
                        self._release(stream, reusable=True)  # before the yield: the consumer may stop
                        yield piece
                        return
                    yield piece
            except (StopAsyncIteration, grpc.aio.AioRpcError) as exc:
                finished = True
                if reused and not produced and attempt == 0:
                    continue  # a stale stream: once more on a fresh one
                raise self._transport_error(exc) from None
            finally:
                if not reusable:
                    if finished:
                        stream.end()  # the request is over: close the stream without cancelling it
                    else:
                        stream.call.cancel()  # the client left: Triton cancels the request
                    self._release(stream, reusable=False)

    def _transport_error(self, exc: BaseException) -> OpenAIError:
        if isinstance(exc, StopAsyncIteration):
            return OpenAIError(
                "the Triton stream ended before the final response", status=502, type="server_error"
            )
        assert isinstance(exc, grpc.aio.AioRpcError)
        if RESTRICTED in (exc.details() or ""):  # Triton 2.51 answers a missing key UNAVAILABLE
            return OpenAIError(
                f"the Triton server at {self.url} refused the front's API key ({exc.details()}); fix: "
                "start the front with the key Triton was started with",
                status=502,
                type="server_error",
            )
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            return OpenAIError(
                f"the Triton server at {self.url} is unavailable ({exc.details()})",
                status=503,
                type="server_error",
            )
        return OpenAIError(f"Triton gRPC {exc.code().name}: {exc.details()}", status=502, type="server_error")


def _refusal(error: Any, gen: Generation, *, produced: bool) -> OpenAIError:
    """Triton's error response: before any output it decides the status; after some, a 500 (503
    when the model became unavailable: its engine died, or it drains)."""
    text = str(getattr(error, "message", lambda: None)() or error)
    if produced and parse_model_error(text).kind != "UNAVAILABLE":
        message = parse_model_error(text).message
        return OpenAIError(f"the model failed mid-stream: {message}", status=500, type="server_error")
    return model_error(text, gen)


def _piece(response: Any) -> Piece:
    """One ModelInferResponse as a Piece (the speculative statistics ride on the final one)."""
    final = bool(response.parameters["triton_final_response"].bool_param)
    values = _values(response)
    texts = values.get("text_output") or [""]
    counts = values.get("num_output_tokens") or []
    reasons = values.get("finish_reason") or []
    logprobs = _logprobs(values, len(texts)) if "output_log_probs" in values else [None] * len(texts)
    seqs = [
        Seq(text=t, completion_tokens=counts[i] if i < len(counts) else None,
            finish_reason=reasons[i] if final and i < len(reasons) else None, logprobs=logprobs[i])
        for i, t in enumerate(texts)
    ]  # fmt: skip
    piece = Piece(seqs=seqs, prompt_tokens=(values.get("num_input_tokens") or [None])[0], final=final,
                  cached_tokens=(values.get("num_cached_tokens") or [None])[0])  # fmt: skip
    if final:
        piece.stats = {k: (values.get(k) or [None])[0] for k in STATS_OUTPUTS}
    if "prompt_log_probs" in values:
        piece.prompt_ids = values["prompt_token_ids"]
        piece.prompt_logprobs = _rows(values["prompt_token_ids"][1:], values["prompt_log_probs"],
                                      values["prompt_top_token_ids"], values["prompt_top_log_probs"])  # fmt: skip
    return piece


def _rows(ids: list[int], lps: list[float], top_ids: list[int], top_lps: list[float]) -> list[LogprobRow]:
    """Per token: (id, log-probability, its k alternatives), k = len(top_ids) / len(ids)."""
    k = len(top_ids) // len(ids) if ids else 0
    return [(t, lp, tuple(zip(top_ids[j * k : (j + 1) * k], top_lps[j * k : (j + 1) * k])))
            for j, (t, lp) in enumerate(zip(ids, lps))]  # fmt: skip


def _logprobs(values: dict[str, list[Any]], n: int) -> list[list[LogprobRow] | None]:
    """The log-probability outputs of a response (output_token_ids, output_log_probs, output_top_*),
    split into the n sequences by output_lengths (all of them in sequence 0 without it)."""
    rows = _rows(values["output_token_ids"], values["output_log_probs"], values.get("output_top_token_ids", []),
                 values.get("output_top_log_probs", []))  # fmt: skip
    lengths = values.get("output_lengths") or [len(rows)] + [0] * (n - 1)
    out: list[list[LogprobRow] | None] = []
    at = 0
    for length in lengths:
        out.append(rows[at : at + length])
        at += length
    return out


_DTYPES = {"BYTES": np.object_, "BOOL": np.bool_, "INT32": np.int32, "FP32": np.float32, "UINT64": np.uint64}
_Value = tuple[str, str, Any]  # (input name, Triton dtype, values)


def _core_values(gen: Generation) -> list[_Value]:
    """The prompt, streaming, what the response carries, the length, stops and the guide."""
    values: list[_Value] = [
        ("text_input", "BYTES", [(gen.prompt or "").encode("utf-8")]),
        ("streaming", "BOOL", [gen.stream]),
        ("sampling_param_return_perf_metrics", "BOOL", [True]),
        ("return_finish_reason", "BOOL", [True]),
    ]
    if gen.max_tokens is not None:  # else the model's default (SamplingParams.max_tokens)
        values.append(("sampling_param_max_tokens", "INT32", [gen.max_tokens]))
    if gen.stream and not gen.stop:  # with stop strings the front cuts deltas itself (StopHoldback)
        values.append(("streaming_delta", "BOOL", [True]))
    if gen.stop:
        values.append(("sampling_param_stop", "BYTES", [s.encode("utf-8") for s in gen.stop]))
    if gen.stop_token_ids:
        values.append(("sampling_param_stop_token_ids", "INT32", gen.stop_token_ids))
    if gen.ignore_eos:
        values.append(("sampling_param_ignore_eos", "BOOL", [True]))
    if gen.min_tokens is not None:
        values.append(("sampling_param_min_tokens", "INT32", [gen.min_tokens]))
    if gen.keep_special_tokens:
        values.append(("sampling_param_skip_special_tokens", "BOOL", [False]))
    if gen.guide_type is not None:  # TensorRT-LLM's guided-decoding inputs
        values.append(("guided_decoding_guide_type", "BYTES", [gen.guide_type.encode("utf-8")]))
        values.append(("guided_decoding_guide", "BYTES", [gen.guide.encode("utf-8")]))
    return values


def _sampling_values(gen: Generation) -> list[_Value]:
    """Sampling, penalties, bias, bad words, log-probabilities and the number of sequences."""
    values: list[_Value] = []
    for name, dtype in (("temperature", "FP32"), ("top_p", "FP32"), ("top_k", "INT32"), ("seed", "UINT64"),
                        ("logprobs", "INT32"), ("best_of", "INT32"), ("frequency_penalty", "FP32"),
                        ("presence_penalty", "FP32"), ("repetition_penalty", "FP32"), ("min_p", "FP32")):  # fmt: skip
        if getattr(gen, name) is not None:
            values.append((f"sampling_param_{name}", dtype, [getattr(gen, name)]))
    if gen.bad_words:
        values.append(("sampling_param_bad", "BYTES", [w.encode("utf-8") for w in gen.bad_words]))
    if gen.n != 1:
        values.append(("sampling_param_n", "INT32", [gen.n]))
    if scores_prompt(gen):
        values.append(("sampling_param_prompt_logprobs", "INT32", [gen.logprobs or 0]))
    if gen.logit_bias:  # a JSON object on the wire (the model's sampling_param_logit_bias)
        bias = json.dumps({str(t): b for t, b in gen.logit_bias.items()})
        values.append(("sampling_param_logit_bias", "BYTES", [bias.encode("utf-8")]))
    return values
