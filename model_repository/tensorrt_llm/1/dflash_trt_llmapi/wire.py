# SPDX-License-Identifier: Apache-2.0
# Copied verbatim into model repositories as dflash_trt_llmapi/; edit dflash_trt/triton/llmapi/, never a copy.
"""The llmapi wire: TensorRT-LLM's input tensors in, responses and error responses out.

Names and types are NVIDIA's llmapi contract (dflash_trt/triton/repository.py lists the ports). The
codec checks only what is about the wire: tensor shapes, UTF-8, the INT32 range of integer inputs,
the prompt's size in bytes, that streaming needs a decoupled model, and that a guide
(guided_decoding_guide) comes with a known guide type (guided_decoding_guide_type). What a value means
(token counts, sampling ranges, stop ids, whether a guide compiles) is the engine's to judge.

Bounded work: the raw bytes of text_input are checked against max_prompt_bytes (triton_config; by
default BYTES_PER_TOKEN bytes per token of the LLM's max_seq_len) before anything decodes or
tokenizes them.

Every error message ends with a trailer naming its kind (and the field of a refused request), e.g.
"... (error: UNAVAILABLE)" or "... (error: INVALID_ARG, field: max_tokens)": a gRPC stream carries an
error's message but not its code, and Triton's HTTP front answers every model error with 400, so the
OpenAI front reads the trailer (dflash_trt/triton/kserve.py, parse_model_error) to tell a bad request
from a failure and name the field without reading prose.

Streaming: like NVIDIA's model, each streamed response carries the *accumulated* text by default; a
request that sets `streaming_delta: true` gets only the new text in each response instead.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import sys
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from dflash_trt.api.serving import OutputView

# Request inputs mapped one to one onto SamplingParams fields.
SAMPLING_INPUTS = {
    "sampling_param_best_of": "best_of",
    "sampling_param_temperature": "temperature",
    "sampling_param_top_k": "top_k",
    "sampling_param_top_p": "top_p",
    "sampling_param_frequency_penalty": "frequency_penalty",
    "sampling_param_presence_penalty": "presence_penalty",
    "sampling_param_max_tokens": "max_tokens",
    "sampling_param_stop": "stop",
    "sampling_param_seed": "seed",
    "sampling_param_exclude_input_from_output": "exclude_input_from_output",
    "sampling_param_return_perf_metrics": "return_perf_metrics",
    # dflash-trt additions (absent from NVIDIA's model)
    "sampling_param_ignore_eos": "ignore_eos",
    "sampling_param_min_tokens": "min_tokens",
    "sampling_param_stop_token_ids": "stop_token_ids",
    "sampling_param_repetition_penalty": "repetition_penalty",
    "sampling_param_min_p": "min_p",
    "sampling_param_logit_bias": "logit_bias",  # a JSON object from token ids to biases
    "sampling_param_logprobs": "logprobs",  # k: each token's log-probability and the k most likely tokens'
    "sampling_param_n": "n",  # sequences sampled from the prompt (one prefill)
    "sampling_param_prompt_logprobs": "prompt_logprobs",  # k: score the prompt (max_tokens may be 0)
    "sampling_param_bad": "bad",  # words never generated (TensorRT-LLM's SamplingParams.bad)
    "sampling_param_bad_token_ids": "bad_token_ids",
    "sampling_param_skip_special_tokens": "skip_special_tokens",  # false: harmony markers stay in the text
}
LIST_FIELDS = {"stop", "stop_token_ids", "bad", "bad_token_ids"}
# Guided decoding: NVIDIA's inputs (its inflight_batcher_llm model's names), read into the engine's
# GuidedDecodingParams: each guide type and the field its guide sets ("json", any JSON object, takes none).
GUIDE_TYPE_INPUT, GUIDE_INPUT = "guided_decoding_guide_type", "guided_decoding_guide"
GUIDE_FIELDS = {"json": "json_object", "json_schema": "json", "regex": "regex", "ebnf_grammar": "grammar",
                "structural_tag": "structural_tag"}  # fmt: skip
FLAG_INPUTS = ("streaming", "streaming_delta", "return_finish_reason", "return_stop_reason", "stop",
               "return_cumulative_logprob")  # fmt: skip
UNSUPPORTED_INPUTS = ("image_url", "lora_id", "lora_name", "lora_path", "lora_ckpt_source")
PERF_OUTPUTS = (
    ("acceptance_rate", np.float32),
    ("total_accepted_draft_tokens", np.int32),
    ("total_draft_tokens", np.int32),
    ("mean_acceptance_length", np.float32),
    ("num_rounds", np.int32),
    ("total_overturned_draft_tokens", np.int32),
    ("arrival_time_ns", np.int64),
    ("first_scheduled_time_ns", np.int64),
    ("first_token_time_ns", np.int64),
    ("last_token_time_ns", np.int64),
)
# NVIDIA's kv_cache_* outputs and the KV-cache metric each carries (TensorRT-LLM's KvCacheMetrics names)
KV_OUTPUTS = (
    ("kv_cache_reused_block", "num_reused_blocks", np.int32),
    ("kv_cache_missed_block", "num_missed_blocks", np.int32),
    ("kv_cache_alloc_new_blocks", "num_new_allocated_blocks", np.int32),
    ("kv_cache_alloc_total_blocks", "num_total_allocated_blocks", np.int32),
    ("kv_cache_hit_rate", "kv_cache_hit_rate", np.float32),
)
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
BYTES_PER_TOKEN = 32  # default max_prompt_bytes = BYTES_PER_TOKEN * max_seq_len

# The trailer of every error response: its kind (the TritonError code's name) and, for a refused
# request, the field at fault. kserve.py's parse_model_error reads it back.
ERROR_TRAILER = " (error: {kind}{field})"
ERROR_KINDS = ("INVALID_ARG", "UNAVAILABLE", "CANCELLED", "INTERNAL")


class RequestInputError(ValueError):
    """A bad request: answered with INVALID_ARG (HTTP 400); the model keeps serving. `field` names
    the request field at fault (an input's name, or the engine's RequestError.field) when known."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class Unavailable(RuntimeError):
    """The model cannot serve the request (draining, or a dead engine): answered with UNAVAILABLE."""


@dataclasses.dataclass(frozen=True)
class ParsedRequest:
    prompt: str
    sampling: Any  # the engine's SamplingParams
    streaming: bool
    want_metrics: bool  # the client asked for the perf-metric outputs
    include_input: bool  # token_ids echo the prompt (exclude_input_from_output=False)
    flags: dict[str, bool]
    logprobs_implied: bool = False  # logprobs set only because return_cumulative_logprob asked for the sum


def error_text(message: str, kind: str, *, field: str | None = None) -> str:
    """`message` with its trailer, e.g. "max_tokens=0: ... (error: INVALID_ARG, field: max_tokens)"."""
    return message + ERROR_TRAILER.format(kind=kind, field=f", field: {field}" if field else "")


def decode_text(value: Any, field: str) -> str:
    """A wire string as text; invalid UTF-8 is a bad request naming the field."""
    if not isinstance(value, bytes):
        return str(value)
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestInputError(
            f"{field} is not valid UTF-8 ({exc.reason} at byte {exc.start}); send UTF-8 text", field=field
        ) from None


def logit_bias(text: Any, name: str) -> dict[int, float]:
    """sampling_param_logit_bias: a JSON object from token ids to biases (the engine checks ranges)."""
    try:
        value = json.loads(text)
        return {int(k): float(v) for k, v in value.items()}
    except (TypeError, ValueError, AttributeError):
        raise RequestInputError(
            f'{name} must be a JSON object from token ids to numbers, e.g. {{"42": -100}}', field=name
        ) from None


def wire_int(value: Any, field: str) -> int:
    """An integer wire value, range-checked for the INT32 inputs it travels in."""
    item = int(value)
    if not INT32_MIN < item <= INT32_MAX:
        # Triton's HTTP front end stores JSON integers in the input's INT32 by truncation, so a
        # value at the edge of the range most likely did not arrive as it was sent.
        raise RequestInputError(
            f"{field}={item}: outside the INT32 range of this input (over HTTP, Triton wraps JSON integers "
            "beyond +-2147483647 silently); send a value within it",
            field=field,
        )
    return item


def td_ns(value: datetime.timedelta | float | None) -> int:
    """A timing metric in ns: a timedelta (ours; TensorRT-LLM's, pandas.Timedelta included) or seconds."""
    if value is None:
        return 0
    if isinstance(value, datetime.timedelta):
        return int(value.total_seconds() * 1e9)
    return int(float(value) * 1e9)


def perf_values(perf: Any) -> dict[str, float | int]:
    """The PERF_OUTPUTS of a request's perf metrics (0 where the engine has none)."""
    spec, timing = perf.speculative_decoding, perf.timing_metrics
    return {
        "acceptance_rate": spec.acceptance_rate or 0.0,
        "total_accepted_draft_tokens": spec.total_accepted_draft_tokens or 0,
        "total_draft_tokens": spec.total_draft_tokens or 0,
        # dflash-trt extensions, absent from TensorRT-LLM's metrics
        "mean_acceptance_length": getattr(spec, "mean_acceptance_length", 0.0) or 0.0,
        "num_rounds": getattr(spec, "num_rounds", 0) or 0,
        "total_overturned_draft_tokens": getattr(spec, "total_overturned_draft_tokens", 0) or 0,
        "arrival_time_ns": td_ns(timing.arrival_time),
        "first_scheduled_time_ns": td_ns(timing.first_scheduled_time),
        "first_token_time_ns": td_ns(timing.first_token_time),
        "last_token_time_ns": td_ns(timing.last_token_time),
    }


def scored(ids: list[int], rows: list[Any], k: int) -> tuple[list[float], list[tuple[int, float]]]:
    """Tokens `ids` with their {token: Logprob} rows -> each token's log-probability, and the k most
    likely tokens at each position with theirs (most likely first), flattened."""
    own = [row[t].logprob for t, row in zip(ids, rows)]
    top = [(t, lp) for row in rows
           for _, t, lp in sorted((e.rank, t, e.logprob) for t, e in row.items() if e.rank <= k)[:k]]  # fmt: skip
    return own, top


def guided_params_class(sampling_params: type) -> type | None:
    """The engine's GuidedDecodingParams, defined beside its SamplingParams (tensorrt_llm.sampling_params,
    dflash_trt.api.params); None if the engine has none."""
    return getattr(sys.modules.get(sampling_params.__module__), "GuidedDecodingParams", None)


def guided_decoding(kind: str | None, guide: str | None, params: type | None, engine_kind: str) -> Any:
    """guided_decoding_guide_type and guided_decoding_guide as the engine's GuidedDecodingParams (`params`);
    None without either. Whether the guide compiles is the engine's to judge."""
    if kind is None:
        if guide is None:
            return None
        raise RequestInputError(f"{GUIDE_INPUT} is set without {GUIDE_TYPE_INPUT}; send the type too, one of "
                                f"{', '.join(GUIDE_FIELDS)}", field=GUIDE_TYPE_INPUT)  # fmt: skip
    field = GUIDE_FIELDS.get(kind)
    if field is None:
        raise RequestInputError(f"{GUIDE_TYPE_INPUT}={kind!r} is not a guide type; send one of "
                                f"{', '.join(GUIDE_FIELDS)}", field=GUIDE_TYPE_INPUT)  # fmt: skip
    if params is None:
        raise RequestInputError(
            f"{GUIDE_TYPE_INPUT} is not supported by engine {engine_kind}", field=GUIDE_TYPE_INPUT
        )
    if field == "json_object":
        if guide:
            raise RequestInputError(f"{GUIDE_TYPE_INPUT}='json' (any JSON object) takes no {GUIDE_INPUT}; send "
                                    f"{GUIDE_TYPE_INPUT}='json_schema' to enforce a schema, or omit the guide",
                                    field=GUIDE_INPUT)  # fmt: skip
        return params(json_object=True)
    if not guide:
        raise RequestInputError(f"{GUIDE_TYPE_INPUT}={kind!r} needs {GUIDE_INPUT} (its {field} text); send it",
                                field=GUIDE_INPUT)  # fmt: skip
    return params(**{field: guide})


class WireCodec:
    """Reads a Triton request into a ParsedRequest and writes responses and error responses.

    `pb` is triton_python_backend_utils (only the stub has it); `sampling_params` the engine's
    SamplingParams class, whose fields say which sampling inputs the engine takes."""

    def __init__(
        self, pb: Any, *, sampling_params: type, engine_kind: str, max_prompt_bytes: int, decoupled: bool
    ) -> None:
        self._pb = pb
        self._sampling_params = sampling_params
        self._sampling_fields = {f.name for f in dataclasses.fields(sampling_params)}
        guided = "guided_decoding" in self._sampling_fields
        self._guided_params = guided_params_class(sampling_params) if guided else None
        self._engine_kind = engine_kind
        self._max_prompt_bytes = max_prompt_bytes
        self._decoupled = decoupled

    # --- requests -------------------------------------------------------------------------------
    def parse(self, request: Any) -> ParsedRequest:
        """The request's inputs as a prompt, SamplingParams and flags; RequestInputError if the wire
        is wrong (the engine judges the values later, in generate_async)."""
        params = json.loads(request.parameters() or "{}")
        unknown = sorted(k for k in params if not k.startswith("triton_"))
        if unknown:
            raise RequestInputError(
                f"unknown parameter {unknown[0]!r}; inputs are text_input, streaming, sampling_param_*, return_*"
            )
        prompt = self._prompt(request)
        kwargs = self._sampling_kwargs(request)
        guide = guided_decoding(self._text(request, GUIDE_TYPE_INPUT), self._text(request, GUIDE_INPUT),
                                self._guided_params, self._engine_kind)  # fmt: skip
        if guide is not None:
            kwargs["guided_decoding"] = guide
        flags = self._flags(request)
        implied = bool(flags.get("return_cumulative_logprob")) and kwargs.get("logprobs") is None
        if implied:
            kwargs["logprobs"] = 0  # the tokens' own log-probabilities are what the sum needs
        want_metrics = bool(kwargs.get("return_perf_metrics", False))
        kwargs["return_perf_metrics"] = True  # always measured: it feeds the DFlash metrics
        try:
            sampling = self._sampling_params(**kwargs)
        except (TypeError, ValueError) as exc:
            raise RequestInputError(str(exc)) from None
        return ParsedRequest(
            prompt=prompt,
            sampling=sampling,
            streaming=flags.get("streaming", False),
            want_metrics=want_metrics,
            include_input=sampling.exclude_input_from_output is False,
            flags=flags,
            logprobs_implied=implied,
        )

    def _read(self, request: Any, name: str) -> Any:
        tensor = self._pb.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy()

    def _text(self, request: Any, name: str) -> str | None:
        """A one-string input as text (None when absent)."""
        value = self._read(request, name)
        if value is None:
            return None
        if value.size != 1:
            raise RequestInputError(f"{name} must hold exactly one string, got {value.size}", field=name)
        return decode_text(value.reshape(-1)[0], name)

    def _prompt(self, request: Any) -> str:
        """text_input: exactly one string, its raw size bounded before it is decoded or tokenized."""
        raw = self._read(request, "text_input")
        if raw is None or raw.size == 0:
            raise RequestInputError("text_input is required (a non-empty string)", field="text_input")
        if raw.size != 1:
            raise RequestInputError(
                f"text_input must hold exactly one string, got {raw.size} elements", field="text_input"
            )
        first = raw.reshape(-1)[0]
        size = len(first) if isinstance(first, bytes) else len(str(first).encode("utf-8"))
        if size > self._max_prompt_bytes:
            raise RequestInputError(
                f"text_input is {size} bytes, over the limit of {self._max_prompt_bytes} "
                "(triton_config.max_prompt_bytes; default 32 bytes per token of max_seq_len); "
                "shorten the prompt or raise the limit",
                field="text_input",
            )
        prompt = decode_text(first, "text_input")
        if not prompt:
            raise RequestInputError("text_input is empty", field="text_input")
        return prompt

    def _sampling_kwargs(self, request: Any) -> dict[str, Any]:
        """The sampling_param_* inputs as SamplingParams keyword arguments (wire types checked)."""
        kwargs: dict[str, Any] = {}
        for name, field in SAMPLING_INPUTS.items():
            value = self._read(request, name)
            if value is None:
                continue
            if field not in self._sampling_fields:
                raise RequestInputError(f"{name} is not supported by engine {self._engine_kind}", field=name)
            flat = value.reshape(-1)
            if field in LIST_FIELDS:
                kwargs[field] = [
                    decode_text(v, name) if isinstance(v, bytes) else wire_int(v, name)
                    if value.dtype.kind in "iu" else v.item()
                    for v in flat
                ]  # fmt: skip
                continue
            if flat.size != 1:
                raise RequestInputError(f"{name} must hold exactly one value, got {flat.size}", field=name)
            item = flat[0]
            if field == "logit_bias":
                kwargs[field] = logit_bias(decode_text(item, name) if isinstance(item, bytes) else item, name)
            elif isinstance(item, bytes):
                kwargs[field] = decode_text(item, name)
            elif value.dtype.kind in "iu" and value.dtype.itemsize <= 4:
                kwargs[field] = wire_int(item, name)
            else:
                kwargs[field] = item.item()
        return kwargs

    def _flags(self, request: Any) -> dict[str, bool]:
        flags = {}
        for name in FLAG_INPUTS:
            v = self._read(request, name)
            if v is None:
                continue
            if v.size != 1:
                raise RequestInputError(f"{name} must hold exactly one value, got {v.size}", field=name)
            flags[name] = bool(v.reshape(-1)[0])
        for name in UNSUPPORTED_INPUTS:
            if self._read(request, name) is not None:
                raise RequestInputError(f"{name} is not supported (text-only, no LoRA adapters)", field=name)
        if flags.get("streaming") and not self._decoupled:
            raise RequestInputError("streaming=true needs a decoupled model (triton_config.decoupled: true)")
        return flags

    # --- responses ------------------------------------------------------------------------------
    def response(self, output: OutputView, parsed: ParsedRequest) -> Any:
        """One output as an InferenceResponse: the text (accumulated, or the delta with
        streaming_delta), token counts, and the reasons and perf metrics the request asked for. With n
        sequences (sampling_param_n, best_of) the per-sequence outputs hold n values, in sequence
        order; the perf metrics are sequence 0's."""
        pb = self._pb
        comps = list(output.outputs)
        flags = parsed.flags
        n_in = len(output.prompt_token_ids or [])
        skip = n_in if parsed.include_input else 0
        texts = [(c.text_diff if flags.get("streaming_delta") else c.text).encode("utf-8") for c in comps]
        tensors = [
            pb.Tensor("text_output", np.array(texts, dtype=object)),
            pb.Tensor(
                "num_output_tokens", np.array([len(c.token_ids) - skip for c in comps], dtype=np.int32)
            ),
            pb.Tensor("num_input_tokens", np.array([n_in], dtype=np.int32)),
            pb.Tensor(
                "num_cached_tokens", np.array([getattr(output, "num_cached_tokens", 0) or 0], dtype=np.int32)
            ),
        ]
        if flags.get("return_finish_reason"):
            tensors.append(
                pb.Tensor("finish_reason", np.array([str(c.finish_reason) for c in comps], dtype=object))
            )
        if flags.get("return_stop_reason"):
            tensors.append(
                pb.Tensor("stop_reason", np.array([str(c.stop_reason) for c in comps], dtype=object))
            )
        perf = comps[0].request_perf_metrics
        if parsed.want_metrics and perf is not None:
            values = perf_values(perf)
            for name, dtype in PERF_OUTPUTS:
                tensors.append(pb.Tensor(name, np.array([values[name]], dtype=dtype)))
            tensors += self._kv_tensors(getattr(perf, "kv_cache_metrics", None))
        if getattr(comps[0], "logprobs", None) is not None:
            tensors += self._logprob_tensors(comps, parsed)
        prompt_rows = getattr(comps[0], "prompt_logprobs", None)
        if output.finished and prompt_rows is not None:
            tensors += self._prompt_tensors(output.prompt_token_ids, prompt_rows, parsed)
        return pb.InferenceResponse(output_tensors=tensors)

    def _prompt_tensors(self, prompt_ids: Any, rows: list[Any], parsed: ParsedRequest) -> list[Any]:
        """With sampling_param_prompt_logprobs = k, in the final response: the prompt's tokens,
        prompt_token_ids [L], the log-probability of each after the first, prompt_log_probs [L - 1], and
        the k most likely tokens at each of those positions with theirs, prompt_top_token_ids /
        prompt_top_log_probs [(L - 1) * k] (ours)."""
        pb, k = self._pb, parsed.sampling.prompt_logprobs
        ids = list(prompt_ids)
        own, top = scored(ids[1:], rows[1:], k)
        return [
            pb.Tensor("prompt_token_ids", np.array(ids, dtype=np.int32)),
            pb.Tensor("prompt_log_probs", np.array(own, dtype=np.float32)),
            pb.Tensor("prompt_top_token_ids", np.array([t for t, _ in top], dtype=np.int32)),
            pb.Tensor("prompt_top_log_probs", np.array([lp for _, lp in top], dtype=np.float32)),
        ]

    def _kv_tensors(self, kv: Any) -> list[Any]:
        """NVIDIA's kv_cache_* outputs from the request's KV-cache metrics (none without them)."""
        if kv is None:
            return []
        pb = self._pb
        return [
            pb.Tensor(name, np.array([getattr(kv, field)], dtype=dtype)) for name, field, dtype in KV_OUTPUTS
        ]

    def _logprob_tensors(self, comps: list[Any], parsed: ParsedRequest) -> list[Any]:
        """cumulative_logprob (NVIDIA's, one per sequence) when asked; with sampling_param_logprobs = k,
        per token of the response (the new ones with streaming_delta), sequence after sequence:
        output_log_probs, the k most likely tokens with theirs, output_top_token_ids /
        output_top_log_probs (k per token), the tokens themselves, output_token_ids, and how many
        tokens each sequence has in them, output_lengths [n] (ours)."""
        pb, out = self._pb, []
        if parsed.flags.get("return_cumulative_logprob"):
            out.append(pb.Tensor("cumulative_logprob", np.array([c.cumulative_logprob for c in comps],
                                                                 dtype=np.float32)))  # fmt: skip
        k = parsed.sampling.logprobs
        if k is None or parsed.logprobs_implied:
            return out
        toks: list[int] = []
        own: list[float] = []
        top: list[tuple[int, float]] = []
        lengths = []
        for comp in comps:
            every = comp.logprobs or []  # a sequence with no output yet has none
            n = len(comp.token_ids_diff) if parsed.flags.get("streaming_delta") else len(every)
            rows = every[len(every) - n :]
            ids = list(comp.token_ids)[len(comp.token_ids) - n :]
            toks += ids
            mine, alternatives = scored(ids, rows, k)
            own += mine
            top += alternatives
            lengths.append(n)
        out.append(pb.Tensor("output_token_ids", np.array(toks, dtype=np.int32)))
        out.append(pb.Tensor("output_log_probs", np.array(own, dtype=np.float32)))
        out.append(pb.Tensor("output_top_token_ids", np.array([t for t, _ in top], dtype=np.int32)))
        out.append(pb.Tensor("output_top_log_probs", np.array([lp for _, lp in top], dtype=np.float32)))
        out.append(pb.Tensor("output_lengths", np.array(lengths, dtype=np.int32)))
        return out

    def send_final(self, sender: Any, response: Any) -> None:
        sender.send(response, flags=self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def send_error(self, sender: Any, message: str, kind: str, *, field: str | None = None) -> None:
        """The request's final response: an error of `kind` (one of ERROR_KINDS, a TritonError code's
        name) whose message ends with the trailer. A client that is gone is only logged."""
        pb = self._pb
        code = getattr(pb.TritonError, kind)
        try:
            sender.send(
                pb.InferenceResponse(error=pb.TritonError(error_text(message, kind, field=field), code=code)),
                flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
            )
        except Exception as exc:  # the client may be gone
            pb.Logger.log_warn(f"could not send error response: {exc}")

    def send_unavailable(self, sender: Any, message: str) -> None:
        self.send_error(sender, message, "UNAVAILABLE")
