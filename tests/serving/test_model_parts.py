# SPDX-License-Identifier: Apache-2.0
"""The Triton model's parts (dflash_trt/triton/llmapi/) without Triton: triton_python_backend_utils is a
stand-in here, as each part takes it as an argument. The served behaviour is tested through a real
tritonserver (test_triton.py, test_reliability.py); these pin the rules each part owns, and that the
copy a repository carries imports where dflash-trt is not installed."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from dflash_trt.api.params import GuidedDecodingParams, SamplingParams
from dflash_trt.triton.kserve import parse_model_error
from dflash_trt.triton.llmapi.liveness import DEFAULT_DRAIN_S, drain_budget
from dflash_trt.triton.llmapi.tracking import RequestTracker
from dflash_trt.triton.llmapi.wire import RequestInputError, WireCodec, error_text, guided_params_class
from dflash_trt.triton.repository import PARTS_PACKAGE, render_repository


class TritonError:
    INVALID_ARG, UNAVAILABLE, CANCELLED, INTERNAL = range(4)

    def __init__(self, message: str, code: int) -> None:
        self.message, self.code = message, code


def fake_pb() -> SimpleNamespace:
    logged: list[str] = []
    return SimpleNamespace(
        TritonError=TritonError,
        InferenceResponse=lambda output_tensors=None, error=None: SimpleNamespace(tensors=output_tensors, error=error),
        Tensor=lambda name, value: (name, value),
        TRITONSERVER_RESPONSE_COMPLETE_FINAL=1,
        get_input_tensor_by_name=lambda request, name: request.inputs.get(name),
        Logger=SimpleNamespace(log_warn=logged.append, log_error=logged.append, log_info=logged.append),
        logged=logged,
    )  # fmt: skip


class Input:
    def __init__(self, value: Any) -> None:
        self.value = np.asarray(value)

    def as_numpy(self) -> np.ndarray:
        return self.value


def request(inputs: dict[str, Any], parameters: dict[str, Any] | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        inputs={k: Input(v) for k, v in inputs.items()}, parameters=lambda: json.dumps(parameters or {})
    )


@dataclasses.dataclass
class Sampling:
    max_tokens: int = 32
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    return_perf_metrics: bool = False
    exclude_input_from_output: bool = True


class Sender:
    def __init__(self) -> None:
        self.sent: list[tuple[Any, int]] = []

    def send(self, response: Any, flags: int = 0) -> None:
        self.sent.append((response, flags))


def codec(pb: Any, *, decoupled: bool = True, max_prompt_bytes: int = 64) -> WireCodec:
    return WireCodec(
        pb,
        sampling_params=Sampling,
        engine_kind="dflash_trt",
        max_prompt_bytes=max_prompt_bytes,
        decoupled=decoupled,
    )


def test_the_error_trailer_reads_back_as_kind_and_field():
    text = error_text("max_tokens=0: must be at least 1", "INVALID_ARG", field="max_tokens")
    assert text.endswith(" (error: INVALID_ARG, field: max_tokens)")
    err = parse_model_error(text)
    assert (err.message, err.kind, err.field) == (
        "max_tokens=0: must be at least 1",
        "INVALID_ARG",
        "max_tokens",
    )
    assert parse_model_error(error_text("draining", "UNAVAILABLE")).kind == "UNAVAILABLE"


def test_the_codec_reads_the_wire_into_a_request():
    parsed = codec(fake_pb()).parse(
        request({"text_input": [b"def fib(n):"], "streaming": [True], "sampling_param_max_tokens": np.int32([64]),
                 "sampling_param_stop": [b"\n\n", b"END"], "sampling_param_stop_token_ids": np.int32([2, 3])})
    )  # fmt: skip
    assert parsed.prompt == "def fib(n):" and parsed.streaming and not parsed.want_metrics
    assert parsed.sampling == Sampling(max_tokens=64, stop=["\n\n", "END"], stop_token_ids=[2, 3],
                                       return_perf_metrics=True)  # fmt: skip


def test_skip_special_tokens_false_keeps_special_tokens():
    """The OpenAI front sends it for harmony templates (their channel markers are special tokens)."""
    wire = WireCodec(fake_pb(), sampling_params=SamplingParams, engine_kind="dflash_trt", max_prompt_bytes=64,
                     decoupled=True)  # fmt: skip
    parsed = wire.parse(
        request({"text_input": [b"a"], "sampling_param_skip_special_tokens": np.bool_([False])})
    )
    assert parsed.sampling.skip_special_tokens is False


@pytest.mark.parametrize(
    ("inputs", "field", "match"),
    [
        ({"text_input": [b"\xff"]}, "text_input", "not valid UTF-8"),
        ({"text_input": [b"x" * 65]}, "text_input", "65 bytes, over the limit of 64"),
        ({"text_input": [b"a", b"b"]}, "text_input", "exactly one string"),
        ({"text_input": [b"a"], "sampling_param_max_tokens": np.int32([-(2**31)])}, "sampling_param_max_tokens",
         "INT32 range"),
        ({"text_input": [b"a"], "sampling_param_top_k": np.int32([1])}, "sampling_param_top_k", "not supported"),
        ({"text_input": [b"a"], "lora_id": np.uint64([1])}, "lora_id", "not supported"),
    ],
)  # fmt: skip
def test_the_codec_refuses_a_wrong_wire_naming_the_field(inputs, field, match):
    with pytest.raises(RequestInputError, match=match) as info:
        codec(fake_pb()).parse(request(inputs))
    assert info.value.field == field


def _guided(inputs: dict[str, Any], sampling: type = SamplingParams) -> Any:
    wire = WireCodec(fake_pb(), sampling_params=sampling, engine_kind="dflash_trt", max_prompt_bytes=64,
                     decoupled=True)  # fmt: skip
    return wire.parse(request({"text_input": [b"a"], **inputs})).sampling.guided_decoding


@pytest.mark.parametrize(
    ("guide_type", "guide", "want"),
    [
        ("json", None, GuidedDecodingParams(json_object=True)),
        ("json", "", GuidedDecodingParams(json_object=True)),  # what the OpenAI front sends
        ("json_schema", '{"type": "object"}', GuidedDecodingParams(json='{"type": "object"}')),
        ("regex", "a+", GuidedDecodingParams(regex="a+")),
        ("ebnf_grammar", 'root ::= "a"', GuidedDecodingParams(grammar='root ::= "a"')),
        ("structural_tag", '{"type": "structural_tag"}', GuidedDecodingParams(structural_tag='{"type": "structural_tag"}')),
    ],
)  # fmt: skip
def test_the_guide_inputs_become_the_engines_guided_decoding(guide_type, guide, want):
    inputs = {"guided_decoding_guide_type": [guide_type.encode()]}
    if guide is not None:
        inputs["guided_decoding_guide"] = [guide.encode()]
    assert _guided(inputs) == want
    assert _guided({}) is None


@pytest.mark.parametrize(
    ("inputs", "field", "match"),
    [
        ({"guided_decoding_guide": [b"a+"]}, "guided_decoding_guide_type", "without guided_decoding_guide_type"),
        ({"guided_decoding_guide_type": [b"lark"], "guided_decoding_guide": [b"x"]}, "guided_decoding_guide_type",
         "'lark' is not a guide type; send one of json, json_schema, regex, ebnf_grammar, structural_tag"),
        ({"guided_decoding_guide_type": [b"regex"]}, "guided_decoding_guide", "needs guided_decoding_guide"),
        ({"guided_decoding_guide_type": [b"json_schema"], "guided_decoding_guide": [b""]}, "guided_decoding_guide",
         "needs guided_decoding_guide"),
        ({"guided_decoding_guide_type": [b"json"], "guided_decoding_guide": [b"{}"]}, "guided_decoding_guide",
         "takes no guided_decoding_guide"),
        ({"guided_decoding_guide_type": [b"regex", b"json"]}, "guided_decoding_guide_type", "exactly one string"),
        ({"guided_decoding_guide_type": [b"regex"], "guided_decoding_guide": [b"\xff"]}, "guided_decoding_guide",
         "not valid UTF-8"),
    ],
)  # fmt: skip
def test_a_wrong_guide_is_refused_naming_the_input(inputs, field, match):
    with pytest.raises(RequestInputError, match=match) as info:
        _guided(inputs)
    assert info.value.field == field


def test_an_engine_without_guided_decoding_refuses_the_guide_inputs():
    """An engine whose SamplingParams has no guided_decoding (or no GuidedDecodingParams beside it)."""
    with pytest.raises(RequestInputError, match="not supported by engine dflash_trt") as info:
        _guided({"guided_decoding_guide_type": [b"json"]}, sampling=Sampling)
    assert info.value.field == "guided_decoding_guide_type"
    assert guided_params_class(SamplingParams) is GuidedDecodingParams


def test_streaming_needs_a_decoupled_model_and_parameters_are_refused():
    with pytest.raises(RequestInputError, match="decoupled"):
        codec(fake_pb(), decoupled=False).parse(request({"text_input": [b"a"], "streaming": [True]}))
    with pytest.raises(RequestInputError, match="unknown parameter 'temperature'"):
        codec(fake_pb()).parse(request({"text_input": [b"a"]}, {"temperature": 0.5, "triton_x": 1}))


def test_an_error_response_is_final_and_carries_its_code_and_trailer():
    pb, sender = fake_pb(), Sender()
    codec(pb).send_error(sender, "bad", "INVALID_ARG", field="text_input")
    ((response, flags),) = sender.sent
    assert flags == pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL and response.error.code == TritonError.INVALID_ARG
    assert response.error.message == "bad (error: INVALID_ARG, field: text_input)"


class Handle:
    def __init__(self) -> None:
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True


def test_the_tracker_counts_stops_by_id_and_ends_drained_requests_unavailable():
    pb, counts = fake_pb(), []
    tracker = RequestTracker(
        pb, codec(pb), check_period=0.1, engine_error=lambda: None, on_count=counts.append
    )
    a, b, c = Handle(), Handle(), Handle()
    tracker.track("r1", a), tracker.track("r1", b), tracker.track("r2", c)
    assert tracker.in_flight() == 3 and counts == [1, 2, 3]
    tracker.stop("r1")
    assert a.aborted and b.aborted and not c.aborted
    with pytest.raises(RequestInputError, match="request id"):
        tracker.stop("")
    assert tracker.unavailable_reason() is None
    tracker.begin_drain(5.0)
    assert "draining" in (tracker.unavailable_reason() or "")
    assert tracker.abort_all() == 3 and c.aborted
    sender = Sender()
    output = SimpleNamespace(outputs=[SimpleNamespace(finish_reason="cancelled")])
    tracker.finish(sender, c, output, None, cancelled=False, tokens=7)  # type: ignore[arg-type]
    ((response, _),) = sender.sent
    assert (
        response.error.code == TritonError.UNAVAILABLE and "drain budget 5 s spent" in response.error.message
    )
    for rid, handle in (("r1", a), ("r1", b), ("r2", c)):
        tracker.untrack(rid, handle)
    assert tracker.in_flight() == 0 and counts[-1] == 0


def test_a_failure_is_unavailable_once_the_engine_is_dead_else_internal():
    pb = fake_pb()
    cause: list[str | None] = [None]
    tracker = RequestTracker(
        pb, codec(pb), check_period=0.1, engine_error=lambda: cause[0], on_count=lambda n: None
    )
    sender = Sender()
    tracker.fail(sender, "r", RuntimeError("boom"), tokens=0)
    cause[0] = "EngineDeadError: gone"
    tracker.fail(sender, "r", RuntimeError("boom"), tokens=3)
    kinds = [parse_model_error(r.error.message).kind for r, _ in sender.sent]
    assert (
        kinds == ["INTERNAL", "UNAVAILABLE"] and "after 3 generated tokens" in sender.sent[1][0].error.message
    )


def test_a_drain_file_holds_its_budget():
    assert drain_budget("12.5\n") == 12.5 and drain_budget("-3") == 0.0
    assert drain_budget("") == DEFAULT_DRAIN_S and drain_budget("soon") == DEFAULT_DRAIN_S


def test_a_rendered_repository_carries_parts_that_import_without_dflash_trt(tmp_path):
    render_repository(
        tmp_path,
        llm_args={"model": "m"},
        triton_config={"max_batch_size": 0, "decoupled": True, "engine": "dflash_trt"},
    )
    version_dir = tmp_path / "tensorrt_llm" / "1"
    parts = sorted(p.name for p in (version_dir / PARTS_PACKAGE).glob("*.py"))
    assert parts == sorted(
        p.name for p in (Path(__file__).parents[2] / "dflash_trt/triton/llmapi").glob("*.py")
    )
    # NGC's TensorRT-LLM image serves a `trtllm` bundle without dflash-trt: model.py and the copy of its
    # parts must not need it (triton_python_backend_utils is the stub's; an empty module stands in).
    script = (
        "import sys, types; sys.modules['dflash_trt'] = None; sys.path.insert(0, sys.argv[1]); "
        "sys.modules['triton_python_backend_utils'] = types.ModuleType('triton_python_backend_utils'); "
        f"import model, {PARTS_PACKAGE}.startup, {PARTS_PACKAGE}.wire, {PARTS_PACKAGE}.tracking, "
        f"{PARTS_PACKAGE}.liveness, {PARTS_PACKAGE}.metrics; "
        f"assert model.WireCodec is {PARTS_PACKAGE}.wire.WireCodec"
    )
    run = subprocess.run([sys.executable, "-c", script, str(version_dir)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
