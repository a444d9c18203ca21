# SPDX-License-Identifier: Apache-2.0
"""A TensorRT-LLM-compatible LLM API over the embedded DFlash engine.

Mirrors the subset of `tensorrt_llm.LLM` / `tensorrt_llm.llmapi.SamplingParams` that serving uses,
so one Triton model file runs on both (see README "LLM API subset"). The engine runs in one
background thread; `generate` blocks, `generate_async` returns a handle that is awaitable, async-
and sync-iterable when streaming, and abortable.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_trt.errors import ConfigError, DFlashTrtError, RequestError

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class SamplingParams:
    """Per-request parameters, with TensorRT-LLM's names and defaults.

    temperature/top_k/top_p all None means greedy (TensorRT-LLM's rule); temperature 0 is greedy.
    `stop` strings are excluded from the text unless include_stop_str_in_output. `ignore_eos`
    ignores the end id but keeps explicit stop_token_ids. `min_tokens` defers stopping (it does not
    mask the end token's probability: output stays distributed as the target's).
    `greedy_draft` (dflash-trt extension): at T > 0 propose argmax drafts (one-hot rule).
    """

    max_tokens: int = 32
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    end_id: int | None = None
    pad_id: int | None = None
    min_tokens: int | None = None
    n: int = 1
    best_of: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    exclude_input_from_output: bool = True
    return_perf_metrics: bool = False
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    greedy_draft: bool = False

    def check(self) -> None:
        """Raise RequestError naming the first bad field."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        if self.temperature is not None and (
            not isinstance(self.temperature, (int, float)) or not self.temperature >= 0
        ):
            raise RequestError(f"temperature={self.temperature!r} must be >= 0 (0 = greedy)")
        if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise RequestError(f"top_p={self.top_p!r} must be in (0, 1]")
        if self.top_k is not None and (
            isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0
        ):
            raise RequestError(f"top_k={self.top_k!r} must be an integer >= 0 (0 = off)")
        if self.n != 1 or (self.best_of not in (None, 1)):
            raise RequestError(
                f"n={self.n}, best_of={self.best_of}: only one output per request is supported"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise RequestError(f"{name}={getattr(self, name)} is not supported by the embedded engine")
        if self.repetition_penalty not in (None, 1, 1.0):
            raise RequestError(
                f"repetition_penalty={self.repetition_penalty} is not supported by the embedded engine"
            )
        if self.min_tokens is not None and self.min_tokens < 0:
            raise RequestError(f"min_tokens={self.min_tokens} must be >= 0")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0
        ):
            raise RequestError(f"seed={self.seed!r} must be a non-negative integer")


@dataclass
class KvCacheConfig:
    """Mirror of the KV-cache fields the embedded engine honours."""

    max_tokens: int | None = None
    free_gpu_memory_fraction: float | None = None
    enable_block_reuse: bool | None = None  # accepted; prefix reuse is not implemented (ignored)
    dtype: str = "auto"


@dataclass
class CudaGraphConfig:
    batch_sizes: list[int] | None = None
    max_batch_size: int | None = None
    enable_padding: bool = True


# --------------------------------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------------------------------
@dataclass
class SpeculativeDecodingMetrics:
    acceptance_rate: float  # accepted drafts / proposed drafts
    total_accepted_draft_tokens: int
    total_draft_tokens: int
    # dflash-trt additions
    acceptance_lengths: list[int] = field(default_factory=list)  # per round, bonus included
    mean_acceptance_length: float = 0.0  # tau: mean round length (0.0 before the first round)
    num_rounds: int = 0


@dataclass
class TimingMetrics:
    """Offsets on the engine's monotonic clock (datetime.timedelta, like TensorRT-LLM)."""

    arrival_time: datetime.timedelta
    first_scheduled_time: datetime.timedelta | None
    first_token_time: datetime.timedelta | None
    last_token_time: datetime.timedelta | None


@dataclass
class RequestPerfMetrics:
    timing_metrics: TimingMetrics
    speculative_decoding: SpeculativeDecodingMetrics


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    stop_reason: int | str | None = None
    text_diff: str = ""  # new text since the previous streamed output of this request
    token_ids_diff: list[int] = field(default_factory=list)
    request_perf_metrics: RequestPerfMetrics | None = None

    @property
    def length(self) -> int:
        return len(self.token_ids)


@dataclass
class RequestOutput:
    """One snapshot of a request (TensorRT-LLM's RequestOutput / GenerationResult shape)."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None


class GenerationHandle:
    """What `generate_async` returns: await it, iterate it (sync or async), or abort it."""

    def __init__(self, llm: LLM, prompt: str | None, prompt_ids: list[int], streaming: bool) -> None:
        self._llm = llm
        self.prompt = prompt
        self.prompt_token_ids = prompt_ids
        self.streaming = streaming
        self.request_id: int = -1
        self._cond = threading.Condition()
        self._items: list[RequestOutput] = []
        self._done = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._aqueue: asyncio.Queue[RequestOutput] | None = None
        try:
            self._loop = asyncio.get_running_loop()
            self._aqueue = asyncio.Queue()
        except RuntimeError:
            pass

    # called from the engine thread
    def _push(self, item: RequestOutput) -> None:
        with self._cond:
            if item.finished:
                self._done = True
            if self.streaming or item.finished:
                self._items.append(item)
            self._cond.notify_all()
        if self._loop is not None and self._aqueue is not None and (self.streaming or item.finished):
            with contextlib.suppress(RuntimeError):  # the consumer's loop is closed
                self._loop.call_soon_threadsafe(self._aqueue.put_nowait, item)

    @property
    def finished(self) -> bool:
        return self._done

    def abort(self) -> None:
        """Cancel the request: it finishes with finish_reason 'cancelled' and frees its slot."""
        self._llm._abort(self)

    def result(self, timeout: float | None = None) -> RequestOutput:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._done:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
                self._cond.wait(left)
            return self._items[-1]

    async def aresult(self) -> RequestOutput:
        last = None
        async for item in self:
            last = item
        assert last is not None
        return last

    def __await__(self):
        return self.aresult().__await__()

    def __iter__(self) -> Iterator[RequestOutput]:
        i = 0
        while True:
            with self._cond:
                while i >= len(self._items) and not (self._done and i >= len(self._items)):
                    self._cond.wait()
                if i >= len(self._items):
                    return
                item = self._items[i]
            i += 1
            yield item
            if item.finished:
                return

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        if self._aqueue is None:
            raise RuntimeError("generate_async() must be called inside a running event loop to iterate it")
        while True:
            item = await self._aqueue.get()
            yield item
            if item.finished:
                return


# --------------------------------------------------------------------------------------------------
# The LLM
# --------------------------------------------------------------------------------------------------
_ACCEPTED_NOOP = {
    "backend": ("pytorch", None),
    "trust_remote_code": None,  # any value
    "tensor_parallel_size": (1, None),
    "pipeline_parallel_size": (1, None),
    "moe_expert_parallel_size": (1, None),
    "enable_attention_dp": (False, None),
    "skip_tokenizer_init": (False, None),
}


# Below this width a CPU forward pass is mostly per-operator overhead: extra intra-op threads only
# add synchronisation. Measured on `tiny` (hidden 128, 2 idle cores): plain decoding 168 tok/s on
# one thread vs 140 on two; on a busy machine two threads were ~30x slower.
SINGLE_THREAD_BELOW_HIDDEN = 1024


def cpu_threads_for(hidden_size: int, requested: int | None) -> int | None:
    """The CPU thread count to set (None = leave torch's setting alone)."""
    if requested is not None:
        return requested
    if os.environ.get("OMP_NUM_THREADS") or hidden_size >= SINGLE_THREAD_BELOW_HIDDEN:
        return None
    return 1


class LLM:
    """`LLM(model=..., speculative_config={...}, max_batch_size=..., ...)` on the embedded engine.

    model: `tiny` or a transformers directory. speculative_config: a dict (YAML form) or
    DFlashDecodingConfig with decoding_type 'DFlash', max_draft_len, speculative_model (a z-lab
    drafter directory, or `tiny`), optional draft_len_schedule / max_concurrency.
    dflash-trt additions: device ('auto'|'cpu'|'cuda'), dtype ('auto'|'float32'|'bfloat16'),
    enforce_eager (no CUDA graphs), profile (synchronise to time the round's phases), use_plugins
    (the dflash:: Triton kernels for KV injection, block attention and acceptance; default: on for
    CUDA when triton is installed, False forces the PyTorch path), cpu_threads (torch's intra-op
    threads on CPU, process-wide; default: 1 for models narrower than 1024 when OMP_NUM_THREADS is
    unset, else torch's own default; see `cpu_threads_for`).
    """

    def __init__(
        self,
        model: str,
        *,
        tokenizer: str | Any | None = None,
        speculative_config: Any = None,
        max_batch_size: int = 16,
        max_num_tokens: int = 2048,
        max_seq_len: int | None = None,
        kv_cache_config: KvCacheConfig | dict | None = None,
        cuda_graph_config: CudaGraphConfig | dict | None = None,
        device: str = "auto",
        dtype: str = "auto",
        enforce_eager: bool = False,
        profile: bool = False,
        use_plugins: bool | None = None,
        cpu_threads: int | None = None,
        **kwargs: Any,
    ) -> None:
        for key, value in kwargs.items():
            if key not in _ACCEPTED_NOOP:
                raise TypeError(
                    f"LLM() got an unsupported argument {key!r}; the embedded engine accepts: model, tokenizer, "
                    "speculative_config, max_batch_size, max_num_tokens, max_seq_len, kv_cache_config, "
                    f"cuda_graph_config, device, dtype, enforce_eager, profile, use_plugins, cpu_threads, "
                    f"{', '.join(sorted(_ACCEPTED_NOOP))}"
                )
            allowed = _ACCEPTED_NOOP[key]
            if allowed is not None and value not in allowed:
                raise ConfigError(
                    key, value, "is not supported by the embedded engine", hint=f"use {allowed[0]!r}"
                )
        import torch

        from dflash_trt.engine.checkpoint import read_json
        from dflash_trt.engine.engine import EngineConfig, LLMEngine
        from dflash_trt.engine.loading import default_stop_token_ids, load_tokenizer, resolve_models
        from dflash_trt.engine.spec_config import DFlashDecodingConfig
        from dflash_trt.engine.target import resolve_device, resolve_dtype
        from dflash_trt.models.config import parse_target_config

        spec = DFlashDecodingConfig.from_any(speculative_config) if speculative_config is not None else None
        drafter_arg = None
        if spec is not None:
            if spec.speculative_model is None and model != "tiny":
                raise ConfigError(
                    "speculative_config.speculative_model",
                    None,
                    "is required",
                    hint="point it at the drafter directory",
                )
            if spec.speculative_model not in (None, "tiny"):
                drafter_arg = str(spec.speculative_model)
        models = resolve_models(model, drafter_arg)
        if spec is not None and spec.speculative_model == "tiny":
            from dflash_trt.tiny import ensure_tiny

            models = type(models)(
                target_dir=models.target_dir, drafter_dir=ensure_tiny().drafter, name=models.name
            )
        self.model_dir = models.target_dir
        self.drafter_dir = models.drafter_dir if spec is not None else None
        if isinstance(tokenizer, (str, Path)):
            tok = load_tokenizer(Path(tokenizer))
        elif tokenizer is not None:
            tok = tokenizer
        else:
            tok = load_tokenizer(models.target_dir)
        self.tokenizer = tok
        tcfg = parse_target_config(read_json(models.target_dir / "config.json", what="target config"))
        if max_seq_len is None:
            max_seq_len = min(tcfg.max_position_embeddings or 4096, 4096)
        kv = (
            KvCacheConfig(**kv_cache_config)
            if isinstance(kv_cache_config, dict)
            else kv_cache_config or KvCacheConfig()
        )
        if kv.dtype not in ("auto", None):
            raise ConfigError(
                "kv_cache_config.dtype", kv.dtype, "the embedded engine keeps the KV cache in the model dtype"
            )
        cg = (
            CudaGraphConfig(**cuda_graph_config) if isinstance(cuda_graph_config, dict) else cuda_graph_config
        )
        graphs = not enforce_eager and (cuda_graph_config is None or cg is not None)
        graph_sizes = tuple(sorted(cg.batch_sizes)) if cg is not None and cg.batch_sizes else None
        dev = resolve_device(None if device == "auto" else device)
        dt = resolve_dtype(None if dtype == "auto" else dtype, dev)
        self.device, self.dtype = dev, dt
        if cpu_threads is not None and cpu_threads < 1:
            raise ConfigError(
                "cpu_threads", cpu_threads, "must be >= 1", hint="pass 1 or more, or leave it unset"
            )
        if dev.type == "cpu":
            threads = cpu_threads_for(tcfg.hidden_size, cpu_threads)
            if threads is not None and threads != torch.get_num_threads():
                torch.set_num_threads(threads)
        self.cpu_threads = torch.get_num_threads() if dev.type == "cpu" else None
        self.engine_config = EngineConfig(
            max_batch_size=max_batch_size,
            max_num_tokens=max_num_tokens,
            max_seq_len=max_seq_len,
            kv_max_tokens=kv.max_tokens,
            kv_free_memory_fraction=kv.free_gpu_memory_fraction or 0.9,
            cuda_graphs=graphs,
            graph_batch_sizes=graph_sizes,
            profile=profile,
            use_plugins=use_plugins,
        )
        eos = tuple(default_stop_token_ids(models.target_dir, tok))
        with torch.inference_mode():
            self.engine = LLMEngine(
                target_dir=models.target_dir,
                drafter_dir=self.drafter_dir,
                spec=spec,
                tokenizer=tok,
                config=self.engine_config,
                device=dev,
                dtype=dt,
                eos_token_ids=eos,
            )
        self.speculative_config = spec
        self.args = {
            "model": str(model),
            "max_batch_size": max_batch_size,
            "max_num_tokens": max_num_tokens,
            "max_seq_len": max_seq_len,
            "speculative_config": spec.to_dict() if spec else None,
        }
        self._commands: queue.Queue[tuple] = queue.Queue()
        self._handles: dict[int, GenerationHandle] = {}
        self._stats_lock = threading.Lock()
        self._stats: dict[str, Any] = {}
        self._round_times: collections.deque[float] = collections.deque(maxlen=4096)
        self._rounds_seen = (0, 0.0)
        self._closed = False
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._loop, name="dflash-engine", daemon=True)
        self._thread.start()

    # --- public ------------------------------------------------------------------------------------
    def generate(
        self,
        inputs: str | list[int] | Sequence[str | list[int]],
        sampling_params: Any = None,
        use_tqdm: bool = False,
    ) -> RequestOutput | list[RequestOutput]:
        single = isinstance(inputs, str) or (
            isinstance(inputs, list) and inputs and isinstance(inputs[0], int)
        )
        prompts: list[Any] = [inputs] if single else list(inputs)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ConfigError("sampling_params", len(params), f"must be one per prompt ({len(prompts)})")
        handles = [self.generate_async(p, sp, streaming=False) for p, sp in zip(prompts, params)]
        results = [h.result() for h in handles]
        return results[0] if single else results

    def generate_async(
        self, inputs: str | list[int], sampling_params: Any = None, streaming: bool = False
    ) -> GenerationHandle:
        """Queue one request. Bad input raises RequestError here, before anything is queued."""
        if self._closed:
            raise DFlashTrtError("the LLM was shut down")
        sp = sampling_params or SamplingParams()
        if not isinstance(sp, SamplingParams):
            sp = SamplingParams(
                **{k: getattr(sp, k) for k in SamplingParams.__dataclass_fields__ if hasattr(sp, k)}
            )
        sp.check()
        prompt_text: str | None
        if isinstance(inputs, str):
            if self.tokenizer is None:
                raise RequestError(
                    "a text prompt needs a tokenizer, and this model has none", hint="send token ids"
                )
            if not inputs:
                raise RequestError("prompt is empty", hint="send at least one character")
            prompt_text, ids = inputs, list(self.tokenizer(inputs, add_special_tokens=False)["input_ids"])
        elif isinstance(inputs, (list, tuple)) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in inputs
        ):
            prompt_text, ids = None, [int(t) for t in inputs]
        else:
            raise RequestError(
                f"prompt of type {type(inputs).__name__} is not a string or a list of token ids"
            )
        params = self._resolve(sp)
        self.engine_validate(ids, params)
        handle = GenerationHandle(self, prompt_text, ids, streaming)
        handle._sp = sp  # type: ignore[attr-defined]
        self._commands.put(("add", handle, ids, params))
        return handle

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._commands.put(("shutdown",))
        self._thread.join(timeout=30)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def get_stats(self) -> dict[str, Any]:
        """Engine counters (waiting/active requests, KV pages, phase times)."""
        with self._stats_lock:
            return dict(self._stats)

    def drain_round_times(self) -> list[float]:
        """Durations (s) of the rounds run since the last call: one per engine step with a round."""
        out = []
        while self._round_times:
            out.append(self._round_times.popleft())
        return out

    # --- internals -----------------------------------------------------------------------------------
    def engine_validate(self, ids: list[int], params: Any) -> None:
        from dflash_trt.engine.engine import PAGE_SIZE, check_stop_token_ids

        eng = self.engine
        cfg = self.engine_config
        if not ids:
            raise RequestError("prompt is empty", hint="send at least one token")
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < eng.vocab_size), None)
        if bad is not None:
            raise RequestError(f"prompt_ids[{bad}]={ids[bad]}: out of range for vocab_size={eng.vocab_size}")
        if len(ids) >= cfg.max_seq_len:
            raise RequestError(
                f"prompt has {len(ids)} tokens, not below max_seq_len={cfg.max_seq_len}",
                hint="shorten the prompt or raise max_seq_len",
            )
        if len(ids) + params.max_tokens > cfg.max_seq_len:
            raise RequestError(
                f"max_tokens={params.max_tokens}: prompt ({len(ids)} tokens) + max_tokens exceeds "
                f"max_seq_len={cfg.max_seq_len}",
                hint=f"use max_tokens <= {cfg.max_seq_len - len(ids)}",
            )
        need = -(-(len(ids) + params.max_tokens) // PAGE_SIZE)
        if need > eng.allocator.num_pages - 1:
            raise RequestError(
                f"request needs {need * PAGE_SIZE} KV tokens but the whole cache holds {eng.kv_capacity_tokens}",
                hint="lower max_tokens or raise kv_cache_config.max_tokens",
            )
        if params.stop and self.tokenizer is None:
            raise RequestError(
                "stop strings need a tokenizer, and this model has none", hint="use stop_token_ids"
            )
        check_stop_token_ids(params.stop_token_ids, eng.vocab_size)

    def _resolve(self, sp: SamplingParams):
        from dflash_trt.engine.engine import RequestParams

        if sp.temperature is None:
            temperature = 0.0 if sp.top_k is None and sp.top_p is None else 1.0
        else:
            temperature = float(sp.temperature)
        stops: set[int] = set(sp.stop_token_ids or [])
        if not sp.ignore_eos:
            stops |= {sp.end_id} if sp.end_id is not None else set(self.engine.eos_token_ids)
        stop_strings = (sp.stop,) if isinstance(sp.stop, str) else tuple(sp.stop or ())
        return RequestParams(
            max_tokens=sp.max_tokens,
            temperature=temperature,
            top_k=int(sp.top_k or 0),
            top_p=float(sp.top_p if sp.top_p is not None else 1.0),
            seed=sp.seed,
            stop_token_ids=tuple(sorted(stops)),
            stop=stop_strings,
            min_tokens=int(sp.min_tokens or 0),
            include_stop_str_in_output=sp.include_stop_str_in_output,
            greedy_draft=sp.greedy_draft,
            skip_special_tokens=sp.skip_special_tokens,
        )

    def _abort(self, handle: GenerationHandle) -> None:
        self._commands.put(("abort", handle))

    def _loop(self) -> None:
        import torch

        if self.cpu_threads is not None:
            # OpenMP's thread count is per calling thread: set it again in the engine's own thread.
            torch.set_num_threads(self.cpu_threads)
        with torch.inference_mode():
            while True:
                block = not self.engine.has_work()
                try:
                    while True:
                        cmd = self._commands.get(block=block)
                        block = False
                        if cmd[0] == "shutdown":
                            self._fail_all("the LLM was shut down")
                            return
                        self._apply(cmd)
                except queue.Empty:
                    pass
                if not self.engine.has_work():
                    self._publish_stats()
                    continue
                try:
                    for update in self.engine.step():
                        handle = self._handles.get(update.seq.request_id)
                        if handle is None:
                            continue
                        handle._push(
                            self._snapshot(
                                handle, update.seq, update.text_delta, update.new_token_ids, update
                            )
                        )
                        if update.finished:
                            self._handles.pop(update.seq.request_id, None)
                except Exception as exc:  # keep serving: fail what was in flight, reset the engine
                    log.exception("engine step failed")
                    self._fail_all(f"engine failure: {type(exc).__name__}: {exc}")
                    continue
                self._publish_stats()

    def _apply(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, handle, ids, params = cmd
            try:
                seq = self.engine.add_request(ids, params)
            except DFlashTrtError as exc:
                handle._push(self._error_output(handle, exc.one_line()))
                return
            handle.request_id = seq.request_id
            self._handles[seq.request_id] = handle
        elif cmd[0] == "abort":
            handle = cmd[1]
            aborted = self.engine.abort(handle.request_id) if handle.request_id >= 0 else None
            if aborted is not None:
                self._handles.pop(aborted.request_id, None)
                handle._push(self._snapshot(handle, aborted, "", []))

    def _fail_all(self, message: str) -> None:
        eng = self.engine
        for seq in [*eng.waiting, *eng.prefilling, *eng.running]:
            if not seq.finished:
                eng._finish(seq, "error")
            handle = self._handles.pop(seq.request_id, None)
            if handle is not None:
                out = self._snapshot(handle, seq, "", [])
                out.error = message
                handle._push(out)
        eng.running = []
        while not self._commands.empty():
            cmd = self._commands.get()
            if cmd[0] == "add":
                cmd[1]._push(self._error_output(cmd[1], message))

    def _error_output(self, handle: GenerationHandle, message: str) -> RequestOutput:
        comp = CompletionOutput(index=0, text="", token_ids=[], finish_reason="error")
        return RequestOutput(
            request_id=handle.request_id,
            prompt=handle.prompt,
            prompt_token_ids=handle.prompt_token_ids,
            outputs=[comp],
            finished=True,
            error=message,
        )

    def _td(self, t: float | None) -> datetime.timedelta | None:
        return None if t is None else datetime.timedelta(seconds=t - self._t0)

    def _snapshot(
        self, handle: GenerationHandle, seq: Any, text_diff: str, ids_diff: list[int], at: Any = None
    ) -> RequestOutput:
        """The request as of update `at` (default: its current state)."""
        sp: SamplingParams = handle._sp  # type: ignore[attr-defined]
        n_tok = at.num_tokens if at is not None else len(seq.output_ids)
        n_rounds = at.num_rounds if at is not None else len(seq.acceptance_lengths)
        drafted = at.num_draft_tokens if at is not None else seq.num_draft_tokens
        accepted = at.num_accepted_draft_tokens if at is not None else seq.num_accepted_draft_tokens
        finished = at.finished if at is not None else seq.finished
        token_ids = list(seq.output_ids[:n_tok])
        text = seq.text[: at.text_len] if at is not None else seq.text
        if not sp.exclude_input_from_output:
            token_ids = list(seq.prompt_ids) + token_ids
            text = (handle.prompt or "") + text
        metrics = None
        if sp.return_perf_metrics:
            lengths = list(seq.acceptance_lengths[:n_rounds])
            metrics = RequestPerfMetrics(
                timing_metrics=TimingMetrics(
                    arrival_time=self._td(seq.arrival_time) or datetime.timedelta(0),
                    first_scheduled_time=self._td(seq.first_scheduled_time),
                    first_token_time=self._td(seq.first_token_time),
                    last_token_time=self._td(seq.last_token_time),
                ),
                speculative_decoding=SpeculativeDecodingMetrics(
                    acceptance_rate=(accepted / drafted) if drafted else 0.0,
                    total_accepted_draft_tokens=accepted,
                    total_draft_tokens=drafted,
                    acceptance_lengths=lengths,
                    mean_acceptance_length=(sum(lengths) / n_rounds) if n_rounds else 0.0,
                    num_rounds=n_rounds,
                ),
            )
        comp = CompletionOutput(
            index=0,
            text=text if sp.detokenize else "",
            token_ids=token_ids,
            finish_reason=seq.finish_reason if finished else None,
            stop_reason=seq.stop_reason if finished else None,
            text_diff=text_diff if sp.detokenize else "",
            token_ids_diff=list(ids_diff),
            request_perf_metrics=metrics,
        )
        return RequestOutput(
            request_id=seq.request_id,
            prompt=handle.prompt,
            prompt_token_ids=handle.prompt_token_ids,
            outputs=[comp],
            finished=finished,
        )

    def _publish_stats(self) -> None:
        stats = self.engine.stats()
        rounds, seconds = stats["rounds"], stats["round_s"]
        if rounds > self._rounds_seen[0]:
            per = (seconds - self._rounds_seen[1]) / (rounds - self._rounds_seen[0])
            self._round_times.extend([per] * (rounds - self._rounds_seen[0]))
            self._rounds_seen = (rounds, seconds)
        with self._stats_lock:
            self._stats = stats
