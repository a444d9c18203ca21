# SPDX-License-Identifier: Apache-2.0
"""Render a Triton model repository in TensorRT-LLM's "llmapi" layout.

  <repo>/tensorrt_llm/config.pbtxt   python backend, KIND_CPU, the llmapi inputs/outputs
  <repo>/tensorrt_llm/1/model.py     dflash_trt/triton/templates/model.py, verbatim
  <repo>/tensorrt_llm/1/dflash_trt_llmapi/
                                     the model's parts: the package dflash_trt/triton/llmapi/, verbatim
  <repo>/tensorrt_llm/1/model.yaml   LLM-API kwargs + triton_config

Input and output names are NVIDIA's (so its clients work unchanged) plus a few dflash-trt
additions, all optional. max_batch_size and the decoupled policy live only in model.yaml (the
model's auto_complete_config applies them), as in NVIDIA's repository.

Rendering is strict: every value is required, and the output is checked for leftover template
markers before anything is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from dflash_trt.errors import ConfigError
from dflash_trt.utils.io import dump_yaml

MODEL_NAME = "tensorrt_llm"


@dataclass(frozen=True)
class Port:
    name: str
    data_type: str
    dims: tuple[int, ...]
    optional: bool = True
    ours: bool = False  # a dflash-trt addition (absent from NVIDIA's models)


INPUTS: tuple[Port, ...] = (
    Port("text_input", "TYPE_STRING", (-1,), optional=False),
    Port("image_url", "TYPE_STRING", (-1,)),
    Port("streaming", "TYPE_BOOL", (1,)),
    Port("sampling_param_best_of", "TYPE_INT32", (1,)),
    Port("sampling_param_temperature", "TYPE_FP32", (1,)),
    Port("sampling_param_top_k", "TYPE_INT32", (1,)),
    Port("sampling_param_top_p", "TYPE_FP32", (1,)),
    Port("sampling_param_frequency_penalty", "TYPE_FP32", (1,)),
    Port("sampling_param_presence_penalty", "TYPE_FP32", (1,)),
    Port("sampling_param_max_tokens", "TYPE_INT32", (1,)),
    Port("sampling_param_stop", "TYPE_STRING", (-1,)),
    Port("sampling_param_seed", "TYPE_UINT64", (1,)),
    Port("sampling_param_exclude_input_from_output", "TYPE_BOOL", (1,)),
    Port("sampling_param_return_perf_metrics", "TYPE_BOOL", (1,)),
    Port("return_finish_reason", "TYPE_BOOL", (1,)),
    Port("return_stop_reason", "TYPE_BOOL", (1,)),
    Port("return_cumulative_logprob", "TYPE_BOOL", (1,)),
    Port("stop", "TYPE_BOOL", (1,)),
    Port("lora_id", "TYPE_UINT64", (1,)),
    Port("lora_name", "TYPE_STRING", (1,)),
    Port("lora_path", "TYPE_STRING", (1,)),
    Port("lora_ckpt_source", "TYPE_STRING", (1,)),
    # guided decoding: NVIDIA's names and types from its inflight_batcher_llm model (its llmapi model has
    # none); guide types json, json_schema, regex, ebnf_grammar, and ours, structural_tag
    Port("guided_decoding_guide_type", "TYPE_STRING", (1,)),
    Port("guided_decoding_guide", "TYPE_STRING", (1,)),  # the schema, regex or grammar text
    Port("sampling_param_ignore_eos", "TYPE_BOOL", (1,), ours=True),
    Port("sampling_param_min_tokens", "TYPE_INT32", (1,), ours=True),
    Port("sampling_param_stop_token_ids", "TYPE_INT32", (-1,), ours=True),
    Port("sampling_param_repetition_penalty", "TYPE_FP32", (1,), ours=True),
    Port("sampling_param_min_p", "TYPE_FP32", (1,), ours=True),
    Port("sampling_param_logit_bias", "TYPE_STRING", (1,), ours=True),  # JSON: token id -> bias
    Port("sampling_param_logprobs", "TYPE_INT32", (1,), ours=True),  # k alternatives per token
    Port("sampling_param_n", "TYPE_INT32", (1,), ours=True),  # sequences from one prefill of the prompt
    Port("sampling_param_prompt_logprobs", "TYPE_INT32", (1,), ours=True),  # k: score the prompt
    Port("sampling_param_bad", "TYPE_STRING", (-1,), ours=True),  # words never generated
    Port("sampling_param_bad_token_ids", "TYPE_INT32", (-1,), ours=True),
    # false keeps special tokens in text_output (gpt-oss harmony markers, which the OpenAI front parses)
    Port("sampling_param_skip_special_tokens", "TYPE_BOOL", (1,), ours=True),
    Port("streaming_delta", "TYPE_BOOL", (1,), ours=True),
)

OUTPUTS: tuple[Port, ...] = (
    Port("text_output", "TYPE_STRING", (-1,)),
    Port("finish_reason", "TYPE_STRING", (-1,)),
    Port("stop_reason", "TYPE_STRING", (-1,)),
    Port("cumulative_logprob", "TYPE_FP32", (-1,)),
    Port("kv_cache_reused_block", "TYPE_INT32", (-1,)),
    Port("kv_cache_missed_block", "TYPE_INT32", (-1,)),
    Port("kv_cache_alloc_new_blocks", "TYPE_INT32", (-1,)),
    Port("kv_cache_alloc_total_blocks", "TYPE_INT32", (-1,)),
    Port("kv_cache_hit_rate", "TYPE_FP32", (-1,)),
    Port("arrival_time_ns", "TYPE_INT64", (1,)),
    Port("first_scheduled_time_ns", "TYPE_INT64", (1,)),
    Port("first_token_time_ns", "TYPE_INT64", (1,)),
    Port("last_token_time_ns", "TYPE_INT64", (1,)),
    Port("acceptance_rate", "TYPE_FP32", (1,)),
    Port("total_accepted_draft_tokens", "TYPE_INT32", (1,)),
    Port("total_draft_tokens", "TYPE_INT32", (1,)),
    Port("num_output_tokens", "TYPE_INT32", (-1,), ours=True),  # one per sequence
    Port("num_input_tokens", "TYPE_INT32", (1,), ours=True),
    Port("num_cached_tokens", "TYPE_INT32", (1,), ours=True),  # of them, found in the prefix cache
    Port("mean_acceptance_length", "TYPE_FP32", (1,), ours=True),
    Port("num_rounds", "TYPE_INT32", (1,), ours=True),
    Port("total_overturned_draft_tokens", "TYPE_INT32", (1,), ours=True),
    Port("output_token_ids", "TYPE_INT32", (-1,), ours=True),  # with sampling_param_logprobs
    Port("output_log_probs", "TYPE_FP32", (-1,), ours=True),  # per token of the response
    Port("output_top_token_ids", "TYPE_INT32", (-1,), ours=True),  # k per token, the most likely first
    Port("output_top_log_probs", "TYPE_FP32", (-1,), ours=True),
    Port("output_lengths", "TYPE_INT32", (-1,), ours=True),  # each sequence's tokens in the four above
    Port("prompt_token_ids", "TYPE_INT32", (-1,), ours=True),  # with sampling_param_prompt_logprobs
    Port("prompt_log_probs", "TYPE_FP32", (-1,), ours=True),  # per prompt token after the first
    Port("prompt_top_token_ids", "TYPE_INT32", (-1,), ours=True),  # k per scored prompt token
    Port("prompt_top_log_probs", "TYPE_FP32", (-1,), ours=True),
)

ENGINES = ("dflash_trt", "tensorrt_llm")
TRITON_CONFIG_KEYS = {
    "max_batch_size",
    "decoupled",
    "engine",
    "cancellation_check_period_ms",
    "bundle_root",
    "max_prompt_bytes",
    "engine_process",
}


def render_config_pbtxt(*, model_name: str = MODEL_NAME, instance_count: int = 1) -> str:
    if not model_name or any(c in model_name for c in ' "/\n'):
        raise ConfigError("model_name", model_name, "must be a plain identifier")
    if instance_count < 1:
        raise ConfigError("instance_count", instance_count, "must be >= 1")
    lines = [
        "# Generated by dflash-trt (dflash_trt/triton/repository.py); do not edit.",
        "# max_batch_size and the decoupled policy come from 1/model.yaml (triton_config).",
        f'name: "{model_name}"',
        'backend: "python"',
        "",
    ]
    for section, ports in (("input", INPUTS), ("output", OUTPUTS)):
        lines.append(f"{section} [")
        for i, p in enumerate(ports):
            dims = ", ".join(str(d) for d in p.dims)
            body = [f'    name: "{p.name}"', f"    data_type: {p.data_type}", f"    dims: [ {dims} ]"]
            if section == "input" and p.optional:
                body.append("    optional: true")
            sep = "," if i < len(ports) - 1 else ""
            lines += ["  {", *body, "  }" + sep]
        lines += ["]", ""]
    lines += ["instance_group [", "  {", f"    count: {instance_count}", "    kind: KIND_CPU", "  }", "]", ""]
    return "\n".join(lines)


def render_model_yaml(llm_args: Mapping[str, Any], triton_config: Mapping[str, Any]) -> str:
    missing = {"max_batch_size", "decoupled", "engine"} - set(triton_config)
    if missing:
        raise ConfigError("triton_config", dict(triton_config), f"missing {sorted(missing)}")
    unknown = set(triton_config) - TRITON_CONFIG_KEYS
    if unknown:
        raise ConfigError(
            "triton_config", sorted(unknown), f"unknown keys; allowed: {sorted(TRITON_CONFIG_KEYS)}"
        )
    if triton_config["engine"] not in ENGINES:
        raise ConfigError("triton_config.engine", triton_config["engine"], f"must be one of {ENGINES}")
    if "model" not in llm_args or llm_args["model"] in (None, ""):
        raise ConfigError("llm_api.model", llm_args.get("model"), "is required")
    if "triton_config" in llm_args:
        raise ConfigError(
            "llm_api.triton_config", "...", "belongs in triton_config, not in the LLM arguments"
        )
    _check_no_none(llm_args, "llm_api")
    header = (
        "# Generated by dflash-trt; do not edit. LLM-API arguments (passed to LLM(**args)) and the\n"
        "# Triton settings the model's auto_complete_config applies.\n"
    )
    return header + dump_yaml({**dict(llm_args), "triton_config": dict(triton_config)})


def _check_no_none(value: Any, path: str) -> None:
    if value is None:
        raise ConfigError(path, None, "has no value (a rendered repository never holds placeholders)")
    if isinstance(value, Mapping):
        for k, v in value.items():
            _check_no_none(v, f"{path}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_no_none(v, f"{path}[{i}]")


# model.py imports its parts under this name, from the copy next to it: the Python backend puts the
# model's directory on sys.path, and the serving image need not have dflash-trt (NGC's TensorRT-LLM image).
PARTS_PACKAGE = "dflash_trt_llmapi"


def model_py_source() -> str:
    return resources.files("dflash_trt.triton").joinpath("templates/model.py").read_text()


def model_parts_sources() -> dict[str, str]:
    """{file name: source} of the package dflash_trt/triton/llmapi/, which model.py composes."""
    package = resources.files("dflash_trt.triton.llmapi")
    return {
        entry.name: entry.read_text()
        for entry in sorted(package.iterdir(), key=lambda e: e.name)
        if entry.name.endswith(".py")
    }


def render_repository(
    out_dir: Path,
    *,
    llm_args: Mapping[str, Any],
    triton_config: Mapping[str, Any],
    model_name: str = MODEL_NAME,
    instance_count: int = 1,
) -> dict[str, str]:
    """Write the repository under `out_dir` (which should not exist or be empty). Returns
    {relative path: content} of what was written."""
    files = {
        f"{model_name}/config.pbtxt": render_config_pbtxt(
            model_name=model_name, instance_count=instance_count
        ),
        f"{model_name}/1/model.py": model_py_source(),
        **{f"{model_name}/1/{PARTS_PACKAGE}/{name}": text for name, text in model_parts_sources().items()},
        f"{model_name}/1/model.yaml": render_model_yaml(llm_args, triton_config),
    }
    for rel, text in files.items():
        for marker in ("${", "{{", "}}", "<PLACEHOLDER>"):
            if marker in text and not rel.endswith(".py"):
                raise ConfigError(rel, marker, "a template marker is left in the rendered file")
        path = Path(out_dir) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return files
