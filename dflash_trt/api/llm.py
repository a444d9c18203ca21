# SPDX-License-Identifier: Apache-2.0
"""A TensorRT-LLM-compatible LLM API over the embedded DFlash engine.

Mirrors the subset of `tensorrt_llm.LLM` / `tensorrt_llm.llmapi.SamplingParams` that serving uses,
so one Triton model file runs on both (see docs/llm-api.md). The engine steps on one background
thread; `generate` blocks, `generate_async` returns a handle that is awaitable, async- and
sync-iterable when streaming, and abortable. Requests are validated once, by the engine's
`add_request`, whose errors reach the caller unchanged.
"""

from __future__ import annotations

import collections
import datetime
import functools
import gc
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_trt.api.handle import GenerationHandle, Wakes
from dflash_trt.api.outputs import (
    CompletionOutput,
    KvCacheMetrics,
    Logprob,
    RequestOutput,
    RequestPerfMetrics,
    SpeculativeDecodingMetrics,
    TimingMetrics,
)
from dflash_trt.api.params import CudaGraphConfig, KvCacheConfig, SamplingParams
from dflash_trt.errors import ConfigError, DFlashTrtError, EngineDeadError, RequestError

if TYPE_CHECKING:
    from dflash_trt.engine.postprocess import StepUpdate
    from dflash_trt.engine.request import RequestParams
    from dflash_trt.models.sources import ResolvedModels
    from dflash_trt.spec.decoding_config import DFlashDecodingConfig

log = logging.getLogger(__name__)

PromptInput = str | Sequence[int] | Mapping[str, Any]

_ACCEPTED_NOOP = {
    "backend": ("pytorch", None),
    "trust_remote_code": None,  # any value
    "tensor_parallel_size": (1, None),
    "pipeline_parallel_size": (1, None),
    "moe_expert_parallel_size": (1, None),
    "enable_attention_dp": (False, None),
    "skip_tokenizer_init": (False, None),
}


DEFAULT_WEDGE_TIMEOUT_S = 60.0  # a step that makes no progress this long with work pending is a wedge


def cpu_threads_for(num_step_parameters: int, requested: int | None) -> int | None:
    """The CPU thread count to set (None = leave torch's setting alone). A model whose weights stay in
    the caches (utils/device.streams_weights) runs on one thread: its forward pass is mostly per-operator
    overhead, which more threads only synchronise (`tiny`, 2 idle cores: plain decoding 168 tok/s on one
    thread, 140 on two; ~30x slower on two when the machine was busy). One that streams its weights
    reads them faster with every core (SmolLM2-135M: bench/README.md)."""
    from dflash_trt.utils.device import streams_weights

    if requested is not None:
        return requested
    if os.environ.get("OMP_NUM_THREADS") or streams_weights(num_step_parameters):
        return None
    return 1


class LLM:
    """`LLM(model=..., speculative_config={...}, max_batch_size=..., ...)` on the embedded engine.

    model: a packaged pair's name (`tiny`, `smollm2-135m`), a .gguf file or a transformers directory.
    speculative_config: a dict (YAML form) or
    DFlashDecodingConfig with decoding_type 'DFlash', max_draft_len, speculative_model (a z-lab
    drafter directory or a packaged drafter's name; unset: the packaged pair's default), optional draft_len_schedule / max_concurrency, and the dflash-trt
    extension tree_budget (DDTree: verify a tree of that many drafted nodes per round, spec/tree.py;
    0 = linear DFlash; "auto" = chosen per step by measured cost, engine/tree_budget.py).
    dflash-trt additions: device ('auto'|'cpu'|'cuda'), dtype ('auto'|'float32'|'bfloat16'),
    enforce_eager (no CUDA graphs), profile (synchronise to time the round's phases), use_plugins
    (the dflash:: Triton kernels for KV injection, block attention and acceptance; default: on for
    CUDA when triton is installed, False forces the PyTorch path), cpu_threads (the cores a step may
    use on CPU, process-wide; default: 1 for a model whose weights stay in the CPU's caches when
    OMP_NUM_THREADS is unset, else torch's own default; see `cpu_threads_for`; where dflash-trt's bf16
    GEMM runs the linears, it alone uses them all and torch runs on one, layers/cpu_gemm.engine_threads), compile (torch.compile the round with
    inductor; the compilation runs here, before the first request: tens of seconds on CPU),
    wedge_timeout_s (the watchdog: an engine step that makes no progress this long while requests are
    pending kills the engine; None turns the watchdog off).
    Liveness: when the engine thread raises or wedges, every pending and in-flight request ends at
    once with EngineDeadError naming the cause, `engine_error` reports it, and new requests are
    refused with it (docs/serving.md, "Failure modes").
    Prompts take TensorRT-LLM's forms: a string, a list of token ids, {"prompt": str} or
    {"prompt_token_ids": [...]}.
    """

    _closed: bool  # shutdown() was called
    _thread: threading.Thread  # the engine thread

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
        compile: bool | None = None,
        compile_cache: str | None = None,
        wedge_timeout_s: float | None = DEFAULT_WEDGE_TIMEOUT_S,
        guided_decoding_backend: str | None = None,
        **kwargs: Any,
    ) -> None:
        _check_accepted_noops(kwargs)
        _check_wedge_timeout(wedge_timeout_s)
        from dflash_trt.models.checkpoint import read_json
        from dflash_trt.models.sources import dtype_for
        from dflash_trt.models.target_config import parse_target_config
        from dflash_trt.utils.device import resolve_device

        self.device = resolve_device(None if device == "auto" else device)
        # First: later imports (the tokenizer's) fix inductor's cache directory when they load inductor.
        compile, compile_dir = _compile_wanted(compile, self.device, compile_cache)
        spec = _speculative(speculative_config)
        models = _resolve_pair(model, spec)
        self.model_dir = models.target_dir
        self.drafter_dir = models.drafter_dir if spec is not None else None
        self.tokenizer = _tokenizer(tokenizer, models.target_dir)
        tcfg = parse_target_config(read_json(models.target_dir / "config.json", what="target config"))
        if max_seq_len is None:
            max_seq_len = min(tcfg.max_position_embeddings or 4096, 4096)
        self.dtype = dtype_for(None if dtype == "auto" else dtype, self.device, tcfg)
        self.cpu_threads = _set_cpu_threads(self.device, self.dtype, tcfg.num_step_parameters(), cpu_threads)
        self.engine_config = _engine_config(
            max_batch_size=max_batch_size, max_num_tokens=max_num_tokens, max_seq_len=max_seq_len,
            kv_cache_config=kv_cache_config, cuda_graph_config=cuda_graph_config, enforce_eager=enforce_eager,
            profile=profile, use_plugins=use_plugins, compile=compile, compile_dir=compile_dir,
            guided_decoding_backend=guided_decoding_backend,
        )  # fmt: skip
        self.engine = self._load_engine(models.target_dir, spec, compile=compile)
        self.speculative_config = spec
        self.args = {
            "model": str(model),
            "max_batch_size": max_batch_size,
            "max_num_tokens": max_num_tokens,
            "max_seq_len": max_seq_len,
            "speculative_config": spec.to_dict() if spec else None,
        }
        self._start_threads(wedge_timeout_s)

    def _load_engine(self, target_dir: Path, spec: Any, *, compile: bool) -> Any:
        """The engine on the resolved models (compiled and warmed up when `compile`), with everything
        loaded so far frozen out of the cyclic garbage collector."""
        import torch

        from dflash_trt.engine.assemble import build_engine
        from dflash_trt.engine.stand_in import install_from_env
        from dflash_trt.models.sources import default_stop_token_ids

        with torch.inference_mode():
            engine = build_engine(
                target_dir=target_dir,
                drafter_dir=self.drafter_dir,
                spec=spec,
                tokenizer=self.tokenizer,
                config=self.engine_config,
                device=self.device,
                dtype=self.dtype,
                eos_token_ids=tuple(default_stop_token_ids(target_dir, self.tokenizer)),
            )
            # a stand-in (tests and the serving path's benchmark only) runs no round to compile
            stand_in = install_from_env(engine)
            compile = compile and stand_in is None
            self._precompiler = _start_compiled(engine, self._precompile_request) if compile else None
        # Everything allocated so far (modules, the tokenizer, compiled code) lives as long as the LLM:
        # keep it out of the cyclic collector, whose full passes over it cost ~1.5 ms a step otherwise.
        gc.collect()
        gc.freeze()
        _unfreeze_at_exit()
        return engine

    def _precompile_request(self, engine: Any) -> Any:
        """What a background compiler needs to build this engine again (engine/precompile.py)."""
        import dataclasses

        from dflash_trt.engine.precompile import PrecompileRequest
        from dflash_trt.layers import cpu_gemm

        spec = engine.spec
        return PrecompileRequest(
            target_dir=str(self.model_dir),
            drafter_dir=None if self.drafter_dir is None else str(self.drafter_dir),
            spec=None if spec is None or engine.drafter is None else spec.to_dict(),
            engine=dataclasses.asdict(self.engine_config),
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            cpu_threads=self.cpu_threads,
            compile_root=str(self.engine_config.compile_dir),
            eos_token_ids=tuple(engine.eos_token_ids),
            gemm_threads=cpu_gemm.own_threads(),
        )

    # --- public ------------------------------------------------------------------------------------
    def generate(
        self,
        inputs: PromptInput | Sequence[PromptInput],
        sampling_params: Any = None,
        use_tqdm: bool = False,
    ) -> RequestOutput | list[RequestOutput]:
        single = isinstance(inputs, (str, Mapping)) or (
            isinstance(inputs, list) and bool(inputs) and isinstance(inputs[0], int)
        )
        prompts: list[Any] = [inputs] if single else list(inputs)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ConfigError("sampling_params", len(params), f"must be one per prompt ({len(prompts)})")
        # Wake the engine once for the whole list, so that an idle engine admits it together (and also
        # when a later prompt is refused: the ones queued before it still run and finish).
        try:
            handles = [self._submit(p, sp, streaming=False) for p, sp in zip(prompts, params)]
        finally:
            self._wake.set()
        results = [h.result() for h in handles]
        return results[0] if single else results

    def generate_async(
        self, inputs: PromptInput, sampling_params: Any = None, streaming: bool = False
    ) -> GenerationHandle:
        """Queue one request. Bad input raises RequestError here, before anything is queued."""
        handle = self._submit(inputs, sampling_params, streaming=streaming)
        self._wake.set()
        return handle

    def _submit(self, inputs: PromptInput, sampling_params: Any, *, streaming: bool) -> GenerationHandle:
        sp = sampling_params or SamplingParams()
        if not isinstance(sp, SamplingParams):
            sp = SamplingParams(
                **{k: getattr(sp, k) for k in SamplingParams.__dataclass_fields__ if hasattr(sp, k)}
            )
        sp.check_supported(streaming=streaming)
        prompt_text, ids = self._prompt_ids(inputs)
        handle = self._new_handle(
            prompt=prompt_text, prompt_ids=ids, sampling_params=sp, streaming=streaming, on_abort=self._abort
        )
        with self._submit_lock:
            if self._dead is not None:
                raise EngineDeadError(
                    f"the engine is dead: {self._dead}", hint="create a new LLM (restart the server)"
                )
            if self._closed:
                raise DFlashTrtError("the LLM was shut down", hint="create a new LLM")
            self._live[id(handle)] = handle  # before add_request: the engine may finish it at once
            try:
                req = self.engine.add_request(ids, _request_params(sp, self.tokenizer), owner=handle)
            except BaseException:
                del self._live[id(handle)]
                raise
            handle.request_id = req.request_id
            handle.request_ids = [r.request_id for r in req.group]
            handle.leader = req
        return handle

    def _new_handle(self, **fields: Any) -> GenerationHandle:
        """The handle of a new request (api/process.py's worker makes its own, which it can name to its
        parent)."""
        return GenerationHandle(**fields)

    @property
    def engine_error(self) -> str | None:
        """None while the engine serves (or after a clean shutdown); else why it died: the exception
        its thread raised (type and message), or how long it was wedged."""
        return self._dead

    def shutdown(self) -> None:
        """Stop the engine thread; unfinished requests end with EngineDeadError('the LLM was shut down')."""
        with self._submit_lock:
            if self._closed:
                return
            self._closed = True
        self._wake.set()
        self._released.set()  # an injected hang returns
        self._thread.join(timeout=30 if self._dead is None else 1)  # a wedged thread may never return
        if self._watchdog is not None:
            # It returns at once now. Joined, so that it never drops the last reference to the engine
            # (and frees its tensors) while the interpreter exits: that aborts the process.
            self._watchdog.join(timeout=5)
        if self._precompiler is not None and self._precompiler.poll() is None:
            self._precompiler.terminate()  # its finished classes stay in the cache for the next start
            self._precompiler.wait(timeout=30)

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
    def _prompt_ids(self, inputs: Any) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) from one of TensorRT-LLM's prompt forms."""
        if isinstance(inputs, Mapping):
            keys = set(inputs) & {"prompt", "prompt_token_ids"}
            if len(keys) != 1:
                raise RequestError(
                    f"prompt dict with keys {sorted(inputs)} must have exactly one of "
                    "'prompt' (text) or 'prompt_token_ids' (token ids)",
                    field="prompt",
                )
            inputs = inputs[keys.pop()]
        if isinstance(inputs, str):
            if self.tokenizer is None:
                raise RequestError(
                    "a text prompt needs a tokenizer, and this model has none",
                    field="prompt",
                    hint="send token ids",
                )
            return inputs, list(self.tokenizer(inputs, add_special_tokens=False)["input_ids"])
        if isinstance(inputs, (list, tuple)):
            return None, list(inputs)  # the engine checks every id
        raise RequestError(
            f"prompt of type {type(inputs).__name__} is not a string, a list of token ids, "
            "{'prompt': str} or {'prompt_token_ids': [...]}",
            field="prompt",
        )

    def _abort(self, handle: GenerationHandle) -> None:
        if handle.request_ids:
            for request_id in handle.request_ids:
                self.engine.abort(request_id)
            self._wake.set()

    # --- the engine thread and its watchdog ------------------------------------------------------------
    def _start_threads(self, wedge_timeout_s: float | None) -> None:
        """The counters the engine thread publishes, then the engine thread and its watchdog."""
        from dflash_trt.engine.faults import fault_from_env, with_fault

        self._stats_lock = threading.Lock()
        self._stats: dict[str, Any] = {}
        self._round_times: collections.deque[float] = collections.deque(maxlen=4096)
        warm = self.engine.stats()
        self._rounds_seen = (warm["rounds"], warm["round_s"])  # warm-up rounds are not reported
        self._t0 = time.perf_counter()

        self._submit_lock = threading.Lock()  # orders submissions against shutdown and death
        self._wake = threading.Event()  # set when the engine may have new work
        self._released = threading.Event()  # set at shutdown: ends an injected hang
        self._closed = False
        self._dead: str | None = None  # the cause, once the engine thread raised or wedged
        self._live: dict[int, GenerationHandle] = {}  # id(handle) -> handle, until its final output
        self._progress = 0  # engine steps taken (the watchdog's only per-step cost)
        self._parked = False  # the engine thread waits for work (not a wedge)
        fault = fault_from_env()  # read once: with none set, the step is not wrapped
        self._step = (
            self.engine.step if fault is None else with_fault(self.engine.step, fault, self._released)
        )
        self._thread = threading.Thread(target=self._loop, name="dflash-engine", daemon=True)
        self._thread.start()
        self.wedge_timeout_s = wedge_timeout_s
        self._watchdog: threading.Thread | None = None
        if wedge_timeout_s is not None:
            self._watchdog = threading.Thread(
                target=self._watch, args=(wedge_timeout_s,), name="dflash-watchdog", daemon=True
            )
            self._watchdog.start()

    def _loop(self) -> None:
        import torch

        if self.cpu_threads is not None:
            # OpenMP's thread count is per calling thread: set it again in the engine's own thread.
            torch.set_num_threads(self.cpu_threads)
        try:
            with torch.inference_mode():
                while not self._closed and self._dead is None:
                    if not self.engine.has_work():
                        self._publish_stats()
                        self._parked = True
                        # while rounds compile in the background, look for them now and then
                        self._wake.wait(timeout=1.0 if self.engine.executor.expecting else None)
                        self._parked = False
                        self._wake.clear()
                        self.engine.executor.load_ready()
                        continue
                    updates = self._step()
                    self._progress += 1
                    self._deliver(updates)
                    self._publish_stats()
                if self._dead is None:
                    self._deliver(self.engine.fail_all(), error="the LLM was shut down")
                    self._publish_stats()
        except BaseException as exc:  # the engine's state is now unknown: it serves no more
            log.exception("engine thread failed")
            self._die(f"engine failure: {type(exc).__name__}: {exc}")

    def _watch(self, timeout: float) -> None:
        """Declare the engine wedged when its thread is inside a step, requests are pending, and the
        step count has not moved for `timeout` s (checked every period, at most a second)."""
        period = min(1.0, timeout / 4)
        last, since = self._progress, time.monotonic()  # since: a sample at or after the last progress
        while not self._released.wait(period):
            if self._dead is not None:
                return
            now = time.monotonic()
            if self._progress != last or self._parked or not self._live:
                last, since = self._progress, now
            elif not self._thread.is_alive():
                self._die("the engine thread exited unexpectedly")
            elif now - since >= timeout:
                self._die(f"engine wedged for {now - since:.0f} s: no step finished while "
                          f"{len(self._live)} requests were pending (wedge_timeout_s={timeout:g})")  # fmt: skip

    def _die(self, cause: str) -> None:
        """Mark the engine dead and end every pending and in-flight request with `cause`. Any thread;
        the engine's own state is left alone (its thread may still be stuck inside it)."""
        with self._submit_lock:
            if self._dead is not None:
                return
            self._dead = cause
            handles = list(self._live.values())
            self._live.clear()
        log.error(
            "the engine is dead (%s): failing %d requests; new requests are refused", cause, len(handles)
        )
        for handle in handles:
            handle.fail(cause)
        self._wake.set()  # an idle engine thread exits

    def _deliver(self, updates: list[StepUpdate], *, error: str | None = None) -> None:
        outputs = []
        for update in updates:
            handle: GenerationHandle = update.req.owner
            out = self._snapshot(handle, update)
            out.error = error
            if out.finished:
                self._live.pop(id(handle), None)
            outputs.append((handle, out))
        self._publish(outputs)

    def _publish(self, outputs: list[tuple[GenerationHandle, RequestOutput]]) -> None:
        """Hand one step's outputs to their requests (api/process.py's worker sends them to its parent
        process in one message instead)."""
        wakes = Wakes()
        try:
            for handle, out in outputs:
                handle.push(out, wakes)
        finally:  # what was delivered reaches its consumers whatever failed after it
            wakes.send()

    def _td(self, t: float | None) -> datetime.timedelta | None:
        return None if t is None else datetime.timedelta(0, t - self._t0)  # positional: 2.5x faster

    def _snapshot(self, handle: GenerationHandle, at: StepUpdate) -> RequestOutput:
        """The request as of update `at` (of one of its sequences: `GenerationHandle.record` adds the
        others' latest)."""
        outputs, finished = handle.record(self._completion(handle, at))
        return RequestOutput(
            request_id=handle.request_id,
            prompt=handle.prompt,
            prompt_token_ids=handle.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=handle.leader.cached_tokens if handle.leader is not None else 0,
        )

    def _completion(self, handle: GenerationHandle, at: StepUpdate) -> CompletionOutput:
        """Sequence at.req as of update `at`."""
        req, sp = at.req, handle.sampling_params
        token_ids = list(req.output_ids[: at.num_tokens])
        text = req.text[: at.text_len]
        if not sp.exclude_input_from_output:
            token_ids = list(req.prompt_ids) + token_ids
            text = (handle.prompt or "") + text
        metrics = None
        if sp.return_perf_metrics:
            n_rounds, drafted, accepted = at.num_rounds, at.num_draft_tokens, at.num_accepted_draft_tokens
            lengths = list(req.acceptance_lengths[:n_rounds])
            metrics = RequestPerfMetrics(
                timing_metrics=TimingMetrics(
                    arrival_time=self._td(req.arrival_time) or datetime.timedelta(0),
                    first_scheduled_time=self._td(req.first_scheduled_time),
                    first_token_time=self._td(req.first_token_time),
                    last_token_time=self._td(req.last_token_time),
                ),
                speculative_decoding=SpeculativeDecodingMetrics(
                    acceptance_rate=(accepted / drafted) if drafted else 0.0,
                    total_accepted_draft_tokens=accepted,
                    total_draft_tokens=drafted,
                    acceptance_lengths=lengths,
                    mean_acceptance_length=(sum(lengths) / n_rounds) if n_rounds else 0.0,
                    num_rounds=n_rounds,
                    total_overturned_draft_tokens=at.num_overturned_draft_tokens,
                    tree_budgets=list(req.tree_budgets[:n_rounds]) if self.engine.planner.trees else None,
                ),
                kv_cache_metrics=_kv_cache_metrics(req, handle.leader),
            )
        comp = CompletionOutput(
            index=req.index,
            text=text if sp.detokenize else "",
            token_ids=token_ids,
            finish_reason=req.finish_reason if at.finished else None,
            stop_reason=req.stop_reason if at.finished else None,
            text_diff=at.text_delta if sp.detokenize else "",
            token_ids_diff=list(at.new_token_ids),
            request_perf_metrics=metrics,
        )
        if req.logprobs is not None:  # asked for, or best_of's ranking needs them
            comp.cumulative_logprob = sum(e[0] for e in req.token_logprobs[: at.num_tokens])
        if sp.logprobs is not None:
            comp.logprobs = _logprob_rows(handle.logprob_rows[req.index], req, at.num_tokens, sp.logprobs)
        if sp.prompt_logprobs is not None:
            comp.prompt_logprobs = _prompt_rows(handle, req, sp.prompt_logprobs)
        return comp

    def _publish_stats(self) -> None:
        stats = self.engine.stats()
        rounds, seconds = stats["rounds"], stats["round_s"]
        if rounds > self._rounds_seen[0]:
            per = (seconds - self._rounds_seen[1]) / (rounds - self._rounds_seen[0])
            self._round_times.extend([per] * (rounds - self._rounds_seen[0]))
            self._rounds_seen = (rounds, seconds)
        with self._stats_lock:
            self._stats = stats


# --- construction helpers ------------------------------------------------------------------------
def _check_accepted_noops(kwargs: dict[str, Any]) -> None:
    for key, value in kwargs.items():
        if key not in _ACCEPTED_NOOP:
            raise TypeError(
                f"LLM() got an unsupported argument {key!r}; the embedded engine accepts: model, tokenizer, "
                "speculative_config, max_batch_size, max_num_tokens, max_seq_len, kv_cache_config, "
                f"cuda_graph_config, device, dtype, enforce_eager, profile, use_plugins, cpu_threads, compile, "
                "wedge_timeout_s, guided_decoding_backend, "
                f"{', '.join(sorted(_ACCEPTED_NOOP))}"
            )
        allowed = _ACCEPTED_NOOP[key]
        if allowed is not None and value not in allowed:
            raise ConfigError(
                key, value, "is not supported by the embedded engine", hint=f"use {allowed[0]!r}"
            )


def _check_wedge_timeout(value: float | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
        raise ConfigError(
            "wedge_timeout_s", value, "must be a number of seconds > 0, or None (no watchdog)",
            hint=f"leave it at {DEFAULT_WEDGE_TIMEOUT_S:g}, or raise it for very slow steps",
        )  # fmt: skip


def _compile_wanted(requested: bool | None, device: Any, cache_root: str | None) -> tuple[bool, str | None]:
    """(compile?, the compile cache directory). compile=None (the default) compiles on the CPU where
    torch.compile can run, unless $DFLASH_TRT_COMPILE=0 (a GPU runs CUDA graphs instead:
    engine/compile.py `off_by_default_reason`); compile=True where it cannot warns and serves
    eagerly. Points inductor's caches at the directory."""
    from dflash_trt.engine.compile import (
        COMPILE_ENV,
        off_by_default_reason,
        unsupported_reason,
        use_cache_root,
    )

    if requested is None:
        requested = os.environ.get(COMPILE_ENV, "1") != "0"
        if requested and (why := off_by_default_reason(device)) is not None:
            log.info("compiled rounds are off: %s", why)
            requested = False
    if not requested:
        return False, None
    reason = unsupported_reason(device)
    if reason is not None:
        log.warning("compiled rounds are off: %s; serving with eager rounds", reason)
        return False, None
    directory = use_cache_root(cache_root, device)
    log.info("compile cache: %s", directory)
    return True, str(directory)


def _start_compiled(engine: Any, request: Callable[[Any], Any]) -> Any:
    """Compiled rounds before traffic: loaded from the compile cache when every warm-up class is
    there (seconds), else compiled in a background process while the engine serves eagerly
    (engine/precompile.py; returns its Popen), or compiled here before the first request when
    $DFLASH_TRT_COMPILE_BACKGROUND=0, the cache has no directory, torch cannot save compiled rounds
    (engine/compile.py `saves_compiled_rounds`), or the engine runs on a GPU (a
    second process would load the weights onto the device again and size its KV cache from what the
    first one left free, i.e. compile for other sizes; measured ~80-90 s per class on an H200 host)."""
    from dflash_trt.engine.compile import BACKGROUND_ENV, saves_compiled_rounds
    from dflash_trt.engine.precompile import spawn

    executor = engine.executor
    classes = engine.warm_up_classes()
    # Whether other processes (a background compiler, or helpers beside this one: engine/precompile.py)
    # can compile for this engine: on the CPU, into a cache directory, with a torch that saves rounds.
    handed_over = engine.device.type == "cpu" and executor.directory is not None and saves_compiled_rounds()
    if not handed_over or executor.on_disk(classes) or os.environ.get(BACKGROUND_ENV, "1") == "0":
        _warm_up_compiled(engine, request if handed_over else None)
        return None
    executor.freeze()  # nothing compiles in this process: rounds run eagerly until loaded
    executor.expect(classes)
    return spawn(request(engine), executor.directory)


def _warm_up_compiled(engine: Any, request: Callable[[Any], Any] | None = None) -> None:
    """Compile before traffic, with helper processes when `request` (what they need to build the
    engine) is given; a failed compilation falls back to eager rounds with a warning."""
    import torch

    from dflash_trt.engine.precompile import warm_up_shared

    log.info("compiled rounds: loading or compiling greedy and sampled rounds at batch 1 and 2+")
    try:
        if request is not None:
            seconds = warm_up_shared(engine, request(engine), engine.executor.directory)
        else:
            seconds = engine.warm_up()
        log.info("compiled rounds ready in %.1f s", seconds)
        engine.executor.freeze()  # a shape class not seen in warm-up runs eagerly, never stalls
    except Exception as exc:  # any compiler failure: serving eagerly beats not serving
        log.warning(
            "compiling the round failed (%s: %s); serving with eager rounds",
            type(exc).__name__,
            str(exc).splitlines()[0] if str(exc) else "",
        )
        engine.fail_all()
        engine.executor.disable()
        torch._dynamo.reset()


def _logprob_rows(rows: list[dict[int, Logprob]], req: Any, n: int, k: int) -> list[dict[int, Logprob]]:
    """TensorRT-LLM's [{token: Logprob}] for the first n output tokens (the token itself, then its k most
    likely alternatives), converted once per token: `rows` keeps what earlier outputs converted (a
    stop rule may have dropped tokens since). Returns a copy: earlier outputs keep theirs."""
    del rows[n:]
    for tok, entry in zip(req.output_ids[len(rows) : n], req.token_logprobs[len(rows) : n]):
        rows.append(_row(tok, entry, k))
    return list(rows)


def _kv_cache_metrics(req: Any, leader: Any) -> KvCacheMetrics:
    """TensorRT-LLM's KV-cache figures of a sequence: the prompt's full pages reused from the prefix
    cache or missed (its group's leader looked them up), the pages it holds and those it allocated."""
    from dflash_trt.engine.config import PAGE_SIZE

    source = leader if leader is not None else req
    reused = source.cached_tokens // PAGE_SIZE
    missed = max(0, (len(req.prompt_ids) - 1) // PAGE_SIZE - reused)
    held = req.reserved_pages
    return KvCacheMetrics(num_total_allocated_blocks=held, num_new_allocated_blocks=held - (reused if source is req else 0),
                          num_reused_blocks=reused, num_missed_blocks=missed,
                          kv_cache_hit_rate=reused / (reused + missed) if reused + missed else 0.0)  # fmt: skip


def _prompt_rows(handle: GenerationHandle, req: Any, k: int) -> list[dict[int, Logprob] | None]:
    """The prompt's [{token: Logprob}] rows (None first), converted once per request (every output of
    it carries the same list)."""
    if handle.prompt_rows is None:
        handle.prompt_rows = [None] + [
            _row(tok, entry, k) for tok, entry in zip(req.prompt_ids[1:], req.prompt_token_logprobs)
        ]
    return handle.prompt_rows


def _row(tok: int, entry: Any, k: int) -> dict[int, Logprob]:
    """One token's {token: Logprob}: the token itself first, then its k most likely alternatives."""
    logprob, rank, top = entry
    row = {tok: Logprob(logprob, rank)}
    for i, (t, lp) in enumerate(top[:k]):
        row.setdefault(t, Logprob(lp, i + 1))
    return row


@functools.cache
def _unfreeze_at_exit() -> None:
    """Frozen objects are never collected, not even when the interpreter exits: OpenAI-Triton's bindings
    (nanobind), imported by torch, then print a "leaked N instances" report at every exit. Unfreezing
    before teardown lets it free them."""
    import atexit

    atexit.register(gc.unfreeze)


def _speculative(speculative_config: Any) -> DFlashDecodingConfig | None:
    """The parsed speculative_config (None: plain decoding)."""
    from dflash_trt.spec.decoding_config import DFlashDecodingConfig

    if speculative_config is None:
        return None
    return DFlashDecodingConfig.from_any(speculative_config)


def _resolve_pair(model: str, spec: DFlashDecodingConfig | None) -> ResolvedModels:
    """The target directory and, with a speculative config, the drafter directory (a packaged pair's
    default drafter when speculative_model is unset)."""
    from dflash_trt import pairs
    from dflash_trt.models.sources import resolve_models

    if spec is None:
        return resolve_models(model, None)
    if spec.speculative_model is None and not pairs.is_packaged(model):
        raise ConfigError(
            "speculative_config.speculative_model",
            None,
            "is required",
            hint="point it at the drafter directory",
        )
    models = resolve_models(model, None if spec.speculative_model is None else str(spec.speculative_model))
    if models.drafter_dir is None:
        raise ConfigError(
            "speculative_config.speculative_model",
            None,
            f"is required: this build ships no default drafter for {model!r}",
            hint="point it at a drafter directory",
        )
    return models


def _tokenizer(tokenizer: str | Path | Any | None, target_dir: Path) -> Any | None:
    from dflash_trt.models.sources import load_tokenizer

    if isinstance(tokenizer, (str, Path)):
        return load_tokenizer(Path(tokenizer))
    return tokenizer if tokenizer is not None else load_tokenizer(target_dir)


def _set_cpu_threads(device: Any, dtype: Any, num_step_parameters: int, requested: int | None) -> int | None:
    """Apply the CPU thread policy: `cpu_threads_for` gives the cores a step may use, and
    layers/cpu_gemm.engine_threads how torch and dflash-trt's GEMM share them. Returns torch's count
    for the engine thread (None off the CPU)."""
    import torch

    from dflash_trt.layers import cpu_gemm

    if requested is not None and requested < 1:
        raise ConfigError("cpu_threads", requested, "must be >= 1", hint="pass 1 or more, or leave it unset")
    if device.type != "cpu":
        return None
    budget = cpu_threads_for(num_step_parameters, requested) or cpu_gemm.threads()
    threads = cpu_gemm.engine_threads(dtype, budget)
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    return threads


def _engine_config(
    *,
    kv_cache_config: KvCacheConfig | dict | None,
    cuda_graph_config: CudaGraphConfig | dict | None,
    enforce_eager: bool,
    **fields: Any,
) -> Any:
    from dflash_trt.engine.config import EngineConfig

    kv = (
        KvCacheConfig(**kv_cache_config)
        if isinstance(kv_cache_config, dict)
        else kv_cache_config or KvCacheConfig()
    )
    if kv.dtype not in ("auto", None):
        raise ConfigError(
            "kv_cache_config.dtype", kv.dtype, "the embedded engine keeps the KV cache in the model dtype"
        )
    if kv.enable_block_reuse not in (None, True, False):
        raise ConfigError("kv_cache_config.enable_block_reuse", kv.enable_block_reuse, "must be true or false",
                          hint="omit it (on, TensorRT-LLM's default) or send false")  # fmt: skip
    cg = CudaGraphConfig(**cuda_graph_config) if isinstance(cuda_graph_config, dict) else cuda_graph_config
    return EngineConfig(
        kv_max_tokens=kv.max_tokens,
        prefix_caching=kv.enable_block_reuse is not False,
        kv_free_memory_fraction=kv.free_gpu_memory_fraction or 0.9,
        cuda_graphs=not enforce_eager and (cuda_graph_config is None or cg is not None),
        graph_batch_sizes=cg.graph_batch_sizes(fields["max_batch_size"]) if cg is not None else None,
        **fields,
    )


def _bad_words(sp: SamplingParams, tokenizer: Any) -> tuple[tuple[int, ...], ...]:
    """`bad` strings as token sequences (each encoded alone, without special tokens: TensorRT-LLM's rule)
    and `bad_token_ids` as one-token words."""
    bad = [sp.bad] if isinstance(sp.bad, str) else list(sp.bad or ())
    if bad and tokenizer is None:
        raise RequestError("bad words need a tokenizer, and this model has none", field="bad",
                           hint="send bad_token_ids")  # fmt: skip
    if not all(isinstance(w, str) and w for w in bad):
        raise RequestError(f"bad={sp.bad!r} must be a non-empty string or a list of them", field="bad",
                           hint='send e.g. ["badword"]')  # fmt: skip
    words = [tuple(tokenizer(w, add_special_tokens=False)["input_ids"]) for w in bad]
    return tuple(words) + tuple((t,) for t in sp.bad_token_ids or ())


def _request_params(sp: SamplingParams, tokenizer: Any = None) -> RequestParams:
    """SamplingParams in the engine's terms. Values pass through unchecked: add_request checks them."""
    from dflash_trt.engine.request import RequestParams

    if sp.temperature is None:  # TensorRT-LLM's rule: no sampling field set means greedy
        temperature: Any = 0.0 if sp.top_k is None and sp.top_p is None else 1.0
    else:
        temperature = sp.temperature
    return RequestParams(
        max_tokens=sp.max_tokens,
        temperature=temperature,
        top_k=sp.top_k if sp.top_k is not None else 0,
        top_p=sp.top_p if sp.top_p is not None else 1.0,
        seed=sp.seed,
        stop_token_ids=tuple(sp.stop_token_ids or ()),
        ignore_eos=sp.ignore_eos,
        end_id=sp.end_id,
        stop=(sp.stop,) if isinstance(sp.stop, str) else tuple(sp.stop or ()),
        min_tokens=sp.min_tokens if sp.min_tokens is not None else 0,
        include_stop_str_in_output=sp.include_stop_str_in_output,
        greedy_draft=sp.greedy_draft,
        skip_special_tokens=sp.skip_special_tokens,
        presence_penalty=sp.presence_penalty if sp.presence_penalty is not None else 0.0,
        frequency_penalty=sp.frequency_penalty if sp.frequency_penalty is not None else 0.0,
        repetition_penalty=sp.repetition_penalty if sp.repetition_penalty is not None else 1.0,
        logit_bias=tuple((sp.logit_bias or {}).items()),
        min_p=sp.min_p if sp.min_p is not None else 0.0,
        # best_of > n ranks its sequences by cumulative log-probability: the engine computes them
        logprobs=sp.logprobs if sp.logprobs is not None or sp.num_sequences == sp.n else 0,
        prompt_logprobs=sp.prompt_logprobs,
        bad_words=_bad_words(sp, tokenizer),
        n=sp.num_sequences,
        guide=sp.guided_decoding.guide() if sp.guided_decoding is not None else None,
    )
