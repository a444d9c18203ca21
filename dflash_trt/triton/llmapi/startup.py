# SPDX-License-Identifier: Apache-2.0
# Copied verbatim into model repositories as dflash_trt_llmapi/; edit dflash_trt/triton/llmapi/, never a copy.
"""What the model reads and opens once, when the stub loads it: model.yaml, the engine, the stub's
locale and logging.

model.yaml (next to model.py, or $LLM_CONFIG_PATH) holds LLM-API keyword arguments plus a
`triton_config` block:
  triton_config:
    max_batch_size: 0            # Triton-side batching; the engine batches continuously itself
    decoupled: true              # streaming responses
    engine: dflash_trt | tensorrt_llm
    cancellation_check_period_ms: 100
    max_prompt_bytes: ...        # default: 32 bytes per token of max_seq_len (wire.py)
    bundle_root: ../../..        # relative paths in the LLM arguments are resolved against it
    engine_process: true         # dflash_trt only: the engine in a child process (default true)
The model talks to one engine interface, `dflash_trt.api.serving.ServingLLM`: the embedded engine
`dflash_trt.LLM` (CPU or GPU) implements it as it is, and runs in a child process of the stub behind
`dflash_trt.api.process.ProcessLLM` by default (its rounds then share no GIL with the stub's response
path); `tensorrt_llm.LLM` (GPU) goes through the `TensorRTLLM` adapter below.
"""

from __future__ import annotations

import asyncio
import dataclasses
import locale
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from .wire import BYTES_PER_TOKEN

if TYPE_CHECKING:
    from dflash_trt.api.serving import RequestStream, ServingLLM


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """model.yaml as the model uses it: the LLM arguments (paths resolved) and triton_config's knobs."""

    llm_args: dict[str, Any]
    engine: str  # triton_config.engine: dflash_trt | tensorrt_llm
    engine_process: bool  # dflash_trt only: the engine in a child process
    check_period: float  # seconds between checks for a client's cancellation
    max_prompt_bytes: int
    block_size: int  # speculative_config.max_draft_len + 1 (1: no drafter)


def config_path(model_dir: Path) -> Path:
    """model.yaml next to model.py, or $LLM_CONFIG_PATH (relative to model.py's directory)."""
    env = os.environ.get("LLM_CONFIG_PATH")
    if env:
        path = Path(env)
        return path if path.is_absolute() else model_dir / path
    return model_dir / "model.yaml"


def load_config(pb: Any, model_dir: Path) -> dict[str, Any]:
    """model.yaml as read, checked for the triton_config keys auto_complete_config needs."""
    path = config_path(model_dir)
    with open(path) as f:
        cfg = yaml.safe_load(f)
    if not isinstance(cfg, dict) or not isinstance(cfg.get("triton_config"), dict):
        raise pb.TritonModelException(f"{path}: needs a mapping with a triton_config block")
    for key in ("max_batch_size", "decoupled"):
        if key not in cfg["triton_config"]:
            raise pb.TritonModelException(f"{path}: triton_config.{key} is required")
    return cfg


def load_settings(pb: Any, model_dir: Path) -> ModelSettings:
    """model.yaml with relative paths resolved against the bundle: $DFLASH_TRT_BUNDLE_ROOT, else
    triton_config.bundle_root (relative to model.yaml)."""
    cfg = load_config(pb, model_dir)
    triton_cfg = cfg.pop("triton_config")
    max_seq_len = int(cfg.get("max_seq_len") or 4096)
    root = Path(
        os.environ.get("DFLASH_TRT_BUNDLE_ROOT")
        or (config_path(model_dir).parent / triton_cfg.get("bundle_root", "."))
    )
    cfg = resolve_paths(cfg, root.resolve())
    spec = cfg.get("speculative_config") or {}
    return ModelSettings(
        llm_args=cfg,
        engine=str(triton_cfg.get("engine", "tensorrt_llm")),
        engine_process=bool(triton_cfg.get("engine_process", True)),
        check_period=float(triton_cfg.get("cancellation_check_period_ms", 100)) / 1000.0,
        max_prompt_bytes=int(triton_cfg.get("max_prompt_bytes") or BYTES_PER_TOKEN * max_seq_len),
        block_size=int(spec.get("max_draft_len", 0) if isinstance(spec, dict) else 0) + 1,
    )


def resolve_paths(cfg: dict[str, Any], root: Path) -> dict[str, Any]:
    """The LLM arguments with relative model/tokenizer/drafter paths resolved against the bundle."""

    def fix(value: Any) -> Any:
        if isinstance(value, str) and value and not os.path.isabs(value) and (root / value).exists():
            return str(root / value)
        return value

    cfg = dict(cfg)
    for key in ("model", "tokenizer"):
        if key in cfg:
            cfg[key] = fix(cfg[key])
    spec = cfg.get("speculative_config")
    if isinstance(spec, dict):
        spec = dict(spec)
        for key in ("speculative_model", "speculative_model_dir"):
            if key in spec:
                spec[key] = fix(spec[key])
        cfg["speculative_config"] = spec
    return cfg


class TensorRTLLM:
    """`tensorrt_llm.LLM` as a ServingLLM. TensorRT-LLM binds a request's output queue to the event
    loop running where generate_async is called, so the request is created on the model's loop (the
    worker thread waits for it; TensorRT-LLM then tokenizes there, as in NVIDIA's own model). It has
    no public liveness or counters in ServingLLM's shape: engine_error stays None (a failed
    TensorRT-LLM request raises, and is answered INTERNAL) and the stub heartbeat covers the process."""

    def __init__(self, llm: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._llm = llm
        self._loop = loop

    def generate_async(
        self, inputs: str, sampling_params: Any = None, streaming: bool = False
    ) -> RequestStream:
        async def create() -> RequestStream:
            return self._llm.generate_async(inputs, sampling_params, streaming=streaming)

        return asyncio.run_coroutine_threadsafe(create(), self._loop).result()

    def shutdown(self) -> None:
        self._llm.shutdown()

    @property
    def engine_error(self) -> str | None:
        return None

    def get_stats(self) -> dict[str, Any]:
        return {}

    def drain_round_times(self) -> list[float]:
        return []


def open_engine(pb: Any, settings: ModelSettings, loop: asyncio.AbstractEventLoop) -> tuple[ServingLLM, Any]:
    """The engine named by triton_config.engine and its SamplingParams class. The embedded engine runs
    in a process of its own (dflash_trt/api/process.py) unless triton_config.engine_process is false;
    then on a thread of the stub, sharing its GIL with the response path."""
    kind, cfg = settings.engine, settings.llm_args
    if kind == "tensorrt_llm":
        from tensorrt_llm import LLM as TrtLLM
        from tensorrt_llm import SamplingParams as TrtSamplingParams
        from tensorrt_llm.llmapi.llm_args import update_llm_args_with_extra_dict

        return TensorRTLLM(TrtLLM(**update_llm_args_with_extra_dict({}, cfg)), loop), TrtSamplingParams
    if kind == "dflash_trt":
        from dflash_trt import LLM, SamplingParams

        if settings.engine_process:
            from dflash_trt.api.process import ProcessLLM

            return ProcessLLM(**cfg), SamplingParams
        return LLM(**cfg), SamplingParams
    raise pb.TritonModelException(f"triton_config.engine={kind!r}: use tensorrt_llm or dflash_trt")


def utf8_text_files() -> None:
    """The Python stub starts in the C locale, so open() reads text as ASCII and libraries' UTF-8 data
    files fail to load (torch.compile's inductor templates did). Switch LC_CTYPE to UTF-8 when the
    system has such a locale; ASCII files read the same either way."""
    if locale.getpreferredencoding(False).lower().replace("-", "") == "utf8":
        return
    for name in ("C.UTF-8", "C.utf8", "en_US.UTF-8"):
        try:
            locale.setlocale(locale.LC_CTYPE, name)
            return
        except locale.Error:
            continue


class TritonLogHandler(logging.Handler):
    """dflash_trt's log records into Triton's log (the engine's load and compile progress)."""

    def __init__(self, pb: Any) -> None:
        super().__init__()
        self._pb = pb

    def emit(self, record: logging.LogRecord) -> None:
        text = f"{record.name}: {record.getMessage()}"
        if record.levelno >= logging.ERROR:
            self._pb.Logger.log_error(text)
        elif record.levelno >= logging.WARNING:
            self._pb.Logger.log_warn(text)
        else:
            self._pb.Logger.log_info(text)


def forward_engine_logs(pb: Any) -> None:
    engine_log = logging.getLogger("dflash_trt")
    if not any(isinstance(h, TritonLogHandler) for h in engine_log.handlers):
        engine_log.addHandler(TritonLogHandler(pb))
        engine_log.setLevel(logging.INFO)
        engine_log.propagate = False
