# SPDX-License-Identifier: Apache-2.0
"""Sweeps: closed-loop concurrency and open-loop Poisson request rate, one point at a time.

A run directory holds `summary.json` (configuration, environment, server, metric definitions,
`points`), `requests.jsonl` (every request of every completed point, warm-up included and
flagged) and `points.csv`. Each point is written as soon as it completes, so Ctrl-C keeps the
completed points, and running the same command again skips them (resume). A directory that
holds a run of another configuration is refused; `overwrite=True` discards whatever it holds.

Prompts: each point and phase draws from its own deterministic stream, keyed by the seed and the
point, so warm-up prompts never repeat measured ones (no prefix-cache hits) and two runs with the
same seed (DFlash and AR) see exactly the same prompts.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import dataclasses
import hashlib
import io
import json
import logging
import math
import os
import platform
import random
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from dflash_trt.bench.clients import PROTOCOLS, Client, Sampling, make_client
from dflash_trt.bench.metrics import (
    DEFINITIONS,
    RawResult,
    RequestRecord,
    Retokenizer,
    Slo,
    build_record,
    percentile,
    summarize_point,
    summarize_warmup,
)
from dflash_trt.bench.workload import PromptSource, WorkloadSpec, load_tokenizer
from dflash_trt.errors import UsageError
from dflash_trt.utils.api_key import ApiKey
from dflash_trt.utils.io import read_json_object

log = logging.getLogger(__name__)

SCHEMA = "dflash-trt.bench.sweep/1"
# Config fields that do not change what is measured (excluded from the resume fingerprint).
_NOT_FINGERPRINTED = frozenset({"out", "label", "concurrency", "request_rate", "meta"})


@dataclass(frozen=True, slots=True)
class SweepConfig:
    """Everything a sweep needs; field names match the `bench sweep` options."""

    url: str
    out: str
    protocol: str = "triton-grpc"
    model: str = "tensorrt_llm"
    concurrency: tuple[int, ...] = ()
    request_rate: tuple[float, ...] = ()
    max_concurrency: int | None = None  # request-rate mode: gate (sleep-then-gate, no catch-up)
    burstiness: float = 1.0  # gamma shape of inter-arrival times; 1 = Poisson
    num_requests: int | None = None  # default: 10 x concurrency (rate mode: max(10, 10 x rate))
    duration_s: float | None = None
    warmup: int | None = None  # default: 2 x concurrency
    isl: int | None = None
    osl: int | None = None
    range_ratio: float = 1.0
    system_prompt_tokens: int | None = None  # every request starts with one shared system prompt this long
    turns: int = 1  # multi-turn chats: each conversation's turn k resends turns 0..k-1
    dataset: str | None = None
    tokenizer: str | None = None
    chat: bool = False
    thinking: bool = False
    seed: int = 0
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    sampling_seed: int | None = None
    ignore_eos: bool = True
    num_gpus: int = 1
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    slo_e2el_s: float | None = None
    label: str | None = None
    request_timeout_s: float = 600.0
    extra_inputs: tuple[tuple[str, Any], ...] = ()
    meta: tuple[tuple[str, str], ...] = ()

    def validate(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise UsageError(
                f"--protocol={self.protocol!r}: unknown", hint=f"pick one of {', '.join(PROTOCOLS)}"
            )
        if not self.url:
            raise UsageError("--url is required", hint="pass --url http://HOST:8000 (gRPC: HOST:8001)")
        if not self.out:
            raise UsageError("--out is required", hint="pass --out DIR (e.g. bench/runs/my-run)")
        if bool(self.concurrency) == bool(self.request_rate):
            raise UsageError(
                "pass exactly one of --concurrency and --request-rate",
                hint="e.g. --concurrency 1,2,4,8 (closed loop) or --request-rate 0.5,1,2 (Poisson)",
            )
        if any(c < 1 for c in self.concurrency):
            raise UsageError(
                f"--concurrency={','.join(map(str, self.concurrency))}: values must be >= 1",
                hint="e.g. 1,2,4,8",
            )
        if any(not (r > 0 and math.isfinite(r)) for r in self.request_rate):
            raise UsageError(
                f"--request-rate={','.join(map(str, self.request_rate))}: values must be finite and > 0",
                hint="for an unlimited rate use --concurrency instead",
            )
        if self.num_requests is not None and self.concurrency and self.num_requests < max(self.concurrency):
            raise UsageError(
                f"--num-requests={self.num_requests} is below --concurrency={max(self.concurrency)}: that point never reaches its concurrency",
                hint="pass --num-requests of at least the largest concurrency (10x is customary), or leave it out for 10 x concurrency",
            )
        if self.num_requests is not None and self.duration_s is not None:
            raise UsageError("--num-requests and --duration are mutually exclusive", hint="pass one of them")
        if self.dataset is None:
            if self.isl is None or self.osl is None:
                raise UsageError(
                    "synthetic prompts need --isl and --osl (or pass --dataset FILE.jsonl)",
                    hint="e.g. --isl 1024 --osl 1024 --tokenizer MODEL",
                )
            if self.tokenizer is None:
                raise UsageError(
                    "--isl needs --tokenizer to build prompts of exact length",
                    hint="pass --tokenizer NAME_OR_DIR",
                )
        elif self.isl is not None:
            raise UsageError(
                "--isl and --dataset are mutually exclusive", hint="--dataset prompts have their own lengths"
            )
        if not 0.0 < self.range_ratio <= 1.0:
            raise UsageError(
                f"--range-ratio={self.range_ratio}: must be in (0, 1]",
                hint="1 = exact lengths; InferenceX uses 0.8",
            )
        if self.burstiness <= 0:
            raise UsageError(f"--burstiness={self.burstiness}: must be > 0", hint="1 = Poisson")
        if self.max_concurrency is not None and not self.request_rate:
            raise UsageError(
                "--max-concurrency applies to --request-rate sweeps", hint="drop it, or use --request-rate"
            )
        if self.chat and self.tokenizer is None and self.dataset is None:
            raise UsageError("--chat needs --tokenizer", hint="pass --tokenizer with a chat template")
        self._validate_chats()

    def _validate_chats(self) -> None:
        """--turns and --system-prompt-tokens: chats, and multi-turn ones in a closed loop."""
        if self.turns > 1 and self.request_rate:
            raise UsageError(f"--turns={self.turns}: a conversation's turns go one after another (closed loop)",
                             hint="use --concurrency (conversations in flight) with --turns")  # fmt: skip
        if (self.turns > 1 or self.system_prompt_tokens) and self.dataset is None and not self.chat \
                and self.protocol != "openai-chat":  # fmt: skip
            raise UsageError(
                "--turns and --system-prompt-tokens build chats",
                hint="add --chat (or --protocol openai-chat)",
            )

    def points(self) -> list[PointSpec]:
        out: list[PointSpec] = []
        t = self.turns
        for c in self.concurrency:
            n = None if self.duration_s else _whole(self.num_requests or 10 * c, t)
            warm = _whole(self.warmup if self.warmup is not None else 2 * c, t)
            out.append(PointSpec(f"concurrency={c}", "concurrency", c, None, n, self.duration_s, warm, t))
        for r in self.request_rate:
            n = None if self.duration_s else (self.num_requests or max(10, math.ceil(10 * r)))
            warm_c = self.max_concurrency or max(1, math.ceil(r))
            warm = self.warmup if self.warmup is not None else 2 * warm_c
            out.append(
                PointSpec(
                    f"request_rate={r:g}", "request_rate", self.max_concurrency, r, n, self.duration_s, warm
                )
            )
        return out

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["concurrency"] = list(self.concurrency)
        d["request_rate"] = list(self.request_rate)
        d["extra_inputs"] = dict(self.extra_inputs)
        d["meta"] = dict(self.meta)
        return d

    def fingerprint_fields(self) -> dict[str, Any]:
        return {k: v for k, v in self.to_json().items() if k not in _NOT_FINGERPRINTED}

    def fingerprint(self) -> str:
        blob = json.dumps(self.fingerprint_fields(), sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def slo(self) -> Slo:
        return Slo(ttft_s=self.slo_ttft_s, tpot_s=self.slo_tpot_s, e2el_s=self.slo_e2el_s)

    def workload(self) -> WorkloadSpec:
        return WorkloadSpec(
            isl=self.isl,
            osl=self.osl,
            range_ratio=self.range_ratio,
            dataset=self.dataset,
            chat=self.chat,
            thinking=self.thinking,
            seed=self.seed,
            system_prompt_tokens=self.system_prompt_tokens,
            turns=self.turns,
        )

    def sampling(self) -> Sampling:
        return Sampling(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.sampling_seed,
            ignore_eos=self.ignore_eos,
            thinking=self.thinking,
            extra=self.extra_inputs,
        )


@dataclass(frozen=True, slots=True)
class PointSpec:
    key: str
    mode: str  # "concurrency" | "request_rate"
    concurrency: int | None  # closed loop: streams in flight; rate mode: the --max-concurrency gate
    request_rate: float | None
    num_requests: int | None
    duration_s: float | None
    warmup: int
    turns: int = 1  # requests per conversation (multi-turn chats): counts are whole conversations

    @property
    def warmup_concurrency(self) -> int:
        if self.concurrency:
            return self.concurrency
        return max(1, math.ceil(self.request_rate or 1.0))

    def pool_size(self) -> int:
        """How many distinct prompts the measured phase needs (cycled in duration mode)."""
        if self.num_requests is not None:
            return self.num_requests
        per_s = self.request_rate or float(self.concurrency or 1)
        return _whole(max(64, min(4096, math.ceil(10 * per_s))), self.turns)


def _whole(n: int, turns: int) -> int:
    """n rounded up to whole conversations of `turns` requests."""
    return -(-n // turns) * turns


# ------------------------------------------------------------------------------------- environment
def environment() -> dict[str, Any]:
    from importlib import metadata

    from dflash_trt import __version__

    versions: dict[str, str | None] = {}
    for pkg in ("aiohttp", "tritonclient", "grpcio", "transformers", "tokenizers", "numpy"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return {
        "dflash_trt": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "packages": versions,
        "argv": list(sys.argv),
    }


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# ------------------------------------------------------------------------------------- run state
@dataclass
class RunState:
    out: Path
    summary: dict[str, Any]
    done: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def summary_path(self) -> Path:
        return self.out / "summary.json"

    @property
    def requests_path(self) -> Path:
        return self.out / "requests.jsonl"

    def write(self) -> None:
        from dflash_trt.utils.io import atomic_write_text

        points = sorted(self.done.values(), key=_point_order)
        self.summary["points"] = points
        atomic_write_text(self.summary_path, json.dumps(self.summary, indent=2, default=str) + "\n")
        atomic_write_text(self.out / "points.csv", points_csv(points))

    def append_requests(self, records: Sequence[RequestRecord]) -> None:
        with self.requests_path.open("a", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r.to_json(), separators=(",", ":")) + "\n")
            f.flush()
            os.fsync(f.fileno())


def _point_order(p: dict[str, Any]) -> tuple[int, float]:
    if p.get("mode") == "request_rate":
        return (1, float(p.get("request_rate") or 0.0))
    return (0, float(p.get("concurrency") or 0))


def open_run(cfg: SweepConfig, *, overwrite: bool) -> RunState:
    """Load a run directory to resume it, or start one (refusing another configuration's run)."""
    out = Path(cfg.out)
    path = out / "summary.json"
    fresh: dict[str, Any] = {
        "schema": SCHEMA,
        "label": cfg.label,
        "status": "running",
        "created_at": _now(),
        "config": cfg.to_json(),
        "fingerprint": cfg.fingerprint(),
        "definitions": DEFINITIONS,
        "points": [],
    }
    if path.is_file() and not overwrite:
        old = read_json_object(
            path,
            lambda problem: UsageError(f"--out={out}: {path} is unreadable: it {problem}",
                                       hint="pass a new --out, or --overwrite"),
        )  # fmt: skip
        if old.get("fingerprint") != fresh["fingerprint"]:
            old_cfg = old.get("config") or {}
            new_cfg = cfg.fingerprint_fields()
            diff = [f"{k}: {old_cfg.get(k)!r} -> {v!r}" for k, v in new_cfg.items() if old_cfg.get(k) != v]
            raise UsageError(
                f"--out={out} holds a run with another configuration ({'; '.join(diff[:6]) or 'fingerprint differs'})",
                hint="pass a new --out, or --overwrite to discard the old run",
            )
        kept: dict[str, Any] = {
            k: old[k] for k in ("created_at", "environment", "server", "workload") if k in old
        }
        state = RunState(out=out, summary={**fresh, **kept})
        state.done = {
            p["key"]: p for p in old.get("points", []) if p.get("fingerprint") == fresh["fingerprint"]
        }
        _drop_orphan_requests(state)
        return state
    out.mkdir(parents=True, exist_ok=True)
    (out / "requests.jsonl").unlink(missing_ok=True)
    return RunState(out=out, summary=fresh)


def _drop_orphan_requests(state: RunState) -> None:
    """Remove request lines of points that never completed (interrupted before summary.json)."""
    path = state.requests_path
    if not path.is_file():
        return
    keep, dropped = [], 0
    with path.open(encoding="utf-8") as f:
        for line in f:
            try:
                point = json.loads(line).get("point")
            except json.JSONDecodeError:
                dropped += 1
                continue
            if point in state.done:
                keep.append(line)
            else:
                dropped += 1
    if dropped:
        from dflash_trt.utils.io import atomic_write_text

        atomic_write_text(path, "".join(keep))


_CSV_SKIP = frozenset({"errors", "tokens_per_chunk_hist", "warmup"})


def points_csv(points: Sequence[dict[str, Any]]) -> str:
    cols: list[str] = []
    for p in points:
        for k, v in p.items():
            if k not in _CSV_SKIP and not isinstance(v, (dict, list)) and k not in cols:
                cols.append(k)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for p in points:
        w.writerow({k: ("" if p.get(k) is None else p.get(k)) for k in cols})
    return buf.getvalue()


# ------------------------------------------------------------------------------------- load
class _LagMonitor:
    """Samples the event loop's wake-up delay: a client-bound run shows large lags."""

    def __init__(self, period_s: float = 0.01) -> None:
        self.period_s = period_s
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(self.period_s)
            self.lags.append(max(0.0, loop.time() - t - self.period_s))

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


class _Progress:
    def __init__(self, enabled: bool, total: int | None, desc: str) -> None:
        self.bar: Any = None
        self.errors = 0
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:  # pragma: no cover - tqdm is in the bench extra
                return
            self.bar = tqdm(
                total=total,
                desc=desc,
                unit="req",
                file=sys.stderr,
                leave=False,
                mininterval=0.5,
                dynamic_ncols=True,
            )

    def done(self, raw: RawResult) -> None:
        """One request finished (the on_done callback of the load loops)."""
        self.errors += raw.error is not None
        if self.bar is not None:
            self.bar.update(1)
            if self.errors:
                self.bar.set_postfix(errors=self.errors, refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


async def _closed_loop(
    client: Client,
    payloads: Sequence[Any],
    *,
    concurrency: int,
    num_requests: int | None,
    duration_s: float | None,
    on_done: Callable[[RawResult], None],
    turns: int = 1,
) -> list[RawResult]:
    """Keep `concurrency` requests in flight until num_requests were sent or duration_s passed. With
    turns > 1 a worker takes whole conversations: requests c * turns .. c * turns + turns - 1, in order."""
    results: list[RawResult] = []
    total = None if num_requests is None else -(-num_requests // turns)
    counter = iter(range(total) if total is not None else _count())
    deadline = time.perf_counter() + duration_s if duration_s else None

    async def worker() -> None:
        for c in counter:
            for i in range(c * turns, c * turns + turns):
                if deadline is not None and time.perf_counter() >= deadline:
                    return
                raw = RawResult(index=i)
                results.append(raw)
                await _send(client, payloads[i % len(payloads)], raw)
                on_done(raw)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


def _count() -> Any:
    i = 0
    while True:
        yield i
        i += 1


async def _send(client: Client, payload: Any, raw: RawResult) -> None:
    try:
        await client.send(payload, raw)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # a failed request is counted, never fatal
        raw.error = raw.error or f"{type(exc).__name__}: {exc}"[:300]
        if raw.done_t is None:
            raw.done_t = time.perf_counter()


async def _open_loop(
    client: Client,
    payloads: Sequence[Any],
    *,
    rate: float,
    burstiness: float,
    max_concurrency: int | None,
    num_requests: int | None,
    duration_s: float | None,
    rng: random.Random,
    on_done: Callable[[RawResult], None],
) -> list[RawResult]:
    """Gamma-distributed arrivals at `rate` (burstiness 1 = Poisson); optional concurrency gate."""
    results: list[RawResult] = []
    tasks: list[asyncio.Task[None]] = []
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    start = time.perf_counter()
    next_t = start

    async def one(i: int) -> None:
        raw = RawResult(index=i)
        results.append(raw)
        try:
            await _send(client, payloads[i % len(payloads)], raw)
            on_done(raw)
        finally:
            if gate is not None:
                gate.release()

    for i in _count():
        if num_requests is not None and i >= num_requests:
            break
        next_t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        if duration_s is not None and next_t - start >= duration_s:
            break
        delay = next_t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if gate is not None:
            await gate.acquire()  # sleep-then-gate: late arrivals are not caught up
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    return results


# ------------------------------------------------------------------------------------- the sweep
@dataclass
class _ClientCost:
    """What one phase cost the client: CPU seconds, wall seconds and event-loop lags."""

    t_ref: float  # perf_counter at the start of the phase (records are relative to it)
    cpu_s: float
    wall_s: float
    lags: list[float] = field(default_factory=list)

    def metrics(self, *, out_tokens: int, chunks: int) -> dict[str, Any]:
        cpu, wall, lags = self.cpu_s, self.wall_s, self.lags
        return {
            "client_cpu_s": cpu,
            "client_wall_s": wall,
            "client_cpu_util": cpu / wall if wall > 0 else None,
            "client_cpu_us_per_output_token": cpu * 1e6 / out_tokens if out_tokens else None,
            "client_cpu_us_per_chunk": cpu * 1e6 / chunks if chunks else None,
            "client_loop_lag_p99_ms": percentile(lags, 99.0) * 1e3 if lags else None,
            "client_loop_lag_max_ms": max(lags) * 1e3 if lags else None,
        }


PointCallback = Callable[[dict[str, Any]], None]


class Sweep:
    def __init__(
        self,
        cfg: SweepConfig,
        *,
        progress: bool = False,
        on_point: PointCallback | None = None,
        api_key: ApiKey | None = None,
    ) -> None:
        self.cfg = cfg
        self.progress = progress
        self.on_point = on_point
        self.api_key = api_key  # sent, never recorded: not part of SweepConfig or its outputs

    def run(self, *, overwrite: bool = False) -> dict[str, Any]:
        cfg = self.cfg
        cfg.validate()
        state = open_run(cfg, overwrite=overwrite)
        points = cfg.points()
        pending = [p for p in points if p.key not in state.done]
        if state.done:
            # The fingerprint covers the client's configuration, not what the server runs: say so.
            log.warning(
                "%s: resuming, %d of %d point(s) kept from the earlier run (%s); the server is not "
                "re-checked, pass --overwrite to measure everything again",
                cfg.out, len(points) - len(pending), len(points),
                ", ".join(sorted(state.done)),
            )  # fmt: skip
        state.summary["environment"] = environment()
        if not pending:
            state.summary["status"] = "complete"
            state.write()
            return state.summary
        tokenizer = load_tokenizer(cfg.tokenizer) if cfg.tokenizer else None
        source = PromptSource(cfg.workload(), tokenizer, protocol=cfg.protocol)
        state.summary["workload"] = cfg.workload().describe(cfg.tokenizer)
        retok = Retokenizer(tokenizer) if tokenizer is not None else None
        try:
            asyncio.run(self._run(state, pending, source, retok))
        except KeyboardInterrupt:
            state.summary["status"] = "interrupted"
            state.write()
            raise
        except BaseException:
            state.summary["status"] = "failed"
            state.write()
            raise
        state.summary["status"] = "complete"
        state.write()
        return state.summary

    async def _run(
        self, state: RunState, pending: list[PointSpec], source: PromptSource, retok: Retokenizer | None
    ) -> None:
        cfg = self.cfg
        streams = max([p.concurrency or 0 for p in pending] + [p.warmup_concurrency for p in pending] + [1])
        if any(p.mode == "request_rate" and not p.concurrency for p in pending):
            streams = max(streams, 256)
        client = make_client(
            cfg.protocol,
            cfg.url,
            cfg.model,
            cfg.sampling(),
            request_timeout_s=cfg.request_timeout_s,
            max_streams=streams,
            api_key=self.api_key,
        )
        async with client:
            info = await client.probe()
            state.summary["server"] = info.to_json()
            state.write()
            for spec in pending:
                point = await self._point(client, spec, source, retok)
                state.done[spec.key] = point["summary"]
                state.append_requests(point["records"])
                state.write()
                if self.on_point is not None:
                    self.on_point(point["summary"])

    async def _point(
        self, client: Client, spec: PointSpec, source: PromptSource, retok: Retokenizer | None
    ) -> dict[str, Any]:
        """Warm-up, then the measured phase, of one point; prompts and request bodies are built
        before either is timed."""
        warm_stream, meas_stream = f"{spec.key}/warmup", f"{spec.key}/measure"
        warm_payloads = [client.prepare(source.get(i, stream=warm_stream)) for i in range(spec.warmup)]
        pool = spec.pool_size()
        meas_prompts = [source.get(i, stream=meas_stream) for i in range(pool)]
        meas_payloads = [client.prepare(p) for p in meas_prompts]
        started_at = _now()
        records: list[RequestRecord] = []
        warmup_summary = None
        if spec.warmup:
            raws, cost = await self._timed(client, spec, warm_payloads, warmup=True)
            warm = [
                self._record(r, spec, "warmup", cost.t_ref, source.get(r.index, stream=warm_stream), retok)
                for r in raws
            ]
            self._check_counts(warm)
            warmup_summary = summarize_warmup(warm)
            records.extend(warm)
        raws, cost = await self._timed(client, spec, meas_payloads, warmup=False)
        meas = [
            self._record(r, spec, "measure", cost.t_ref, meas_prompts[r.index % pool], retok) for r in raws
        ]
        self._check_counts(meas)
        records.extend(meas)
        summary = self._summary(spec, meas, cost)
        summary.update(
            {"warmup": warmup_summary, "started_at": started_at, "fingerprint": self.cfg.fingerprint()}
        )
        return {"summary": summary, "records": records}

    async def _timed(
        self, client: Client, spec: PointSpec, payloads: list[Any], *, warmup: bool
    ) -> tuple[list[RawResult], _ClientCost]:
        """One phase under the point's load, with the client's own CPU time and event-loop lag."""
        n = spec.warmup if warmup else spec.num_requests
        bar = _Progress(
            self.progress, n, f"{self.cfg.label or 'run'} {spec.key}" + (" warm-up" if warmup else "")
        )
        lag = _LagMonitor()
        if not warmup:
            lag.start()
        cpu0, t_ref = time.process_time(), time.perf_counter()
        try:
            if warmup:
                concurrency = min(spec.warmup_concurrency, spec.warmup)
                raws = await _closed_loop(client, payloads, concurrency=concurrency, num_requests=n,
                                          duration_s=None, on_done=bar.done, turns=self.cfg.turns)  # fmt: skip
            else:
                raws = await self._load(client, spec, payloads, on_done=bar.done)
        finally:
            cost = _ClientCost(
                t_ref=t_ref, cpu_s=time.process_time() - cpu0, wall_s=time.perf_counter() - t_ref
            )
            if not warmup:
                await lag.stop()
                cost.lags = lag.lags
            bar.close()
        return raws, cost

    async def _load(
        self, client: Client, spec: PointSpec, payloads: list[Any], *, on_done: Callable[[RawResult], None]
    ) -> list[RawResult]:
        """The measured requests: a closed loop at the point's concurrency, or open-loop arrivals."""
        if spec.mode == "concurrency":
            assert spec.concurrency is not None
            return await _closed_loop(client, payloads, concurrency=spec.concurrency, num_requests=spec.num_requests,
                                      duration_s=spec.duration_s, on_done=on_done, turns=self.cfg.turns)  # fmt: skip
        assert spec.request_rate is not None
        return await _open_loop(
            client,
            payloads,
            rate=spec.request_rate,
            burstiness=self.cfg.burstiness,
            max_concurrency=spec.concurrency,
            num_requests=spec.num_requests,
            duration_s=spec.duration_s,
            rng=random.Random(f"dflash-trt-bench-arrivals:{self.cfg.seed}:{spec.key}"),
            on_done=on_done,
        )

    def _summary(self, spec: PointSpec, meas: list[RequestRecord], cost: _ClientCost) -> dict[str, Any]:
        """The point's entry in summary.json: what it was, every metric, and what the client spent."""
        cfg = self.cfg
        summary: dict[str, Any] = {
            "key": spec.key,
            "label": cfg.label,
            "mode": spec.mode,
            "concurrency": spec.concurrency if spec.mode == "concurrency" else None,
            "request_rate": spec.request_rate,
            "max_concurrency": spec.concurrency if spec.mode == "request_rate" else None,
            "num_gpus": cfg.num_gpus,
        }
        summary.update(
            summarize_point(meas, num_gpus=cfg.num_gpus, concurrency=spec.concurrency, slo=cfg.slo())
        )
        if spec.mode == "request_rate":
            starts = [r.start_s for r in meas]
            summary["achieved_request_rate"] = (
                (len(meas) - 1) / (max(starts) - min(starts)) if len(meas) > 1 else None
            )
        summary["intended_concurrency"] = spec.concurrency
        summary.update(
            cost.metrics(out_tokens=summary["output_tokens_total"] or 0, chunks=summary["num_chunks"])
        )
        return summary

    def _record(
        self,
        raw: RawResult,
        spec: PointSpec,
        phase: str,
        t_ref: float,
        prompt: Any,
        retok: Retokenizer | None,
    ) -> RequestRecord:
        return build_record(
            raw,
            point=spec.key,
            phase=phase,
            t_ref=t_ref,
            input_tokens_client=prompt.input_tokens,
            requested_output_tokens=prompt.output_tokens,
            retokenizer=retok,
        )

    def _check_counts(self, records: Sequence[RequestRecord]) -> None:
        if any(r.ok and r.output_tokens is None for r in records):
            raise UsageError(
                "the server reports no token counts (no num_output_tokens / usage), so output tokens cannot be counted",
                hint="pass --tokenizer of the served model to count tokens by re-tokenising the text",
            )


def run_sweep(
    cfg: SweepConfig,
    *,
    overwrite: bool = False,
    progress: bool = False,
    on_point: PointCallback | None = None,
    api_key: ApiKey | None = None,
) -> dict[str, Any]:
    """Run (or resume) one sweep; returns the summary dict (also in OUT/summary.json)."""
    return Sweep(cfg, progress=progress, on_point=on_point, api_key=api_key).run(overwrite=overwrite)


def load_summary(run_dir: str | Path) -> dict[str, Any]:
    """summary.json of a run directory (or the file itself)."""
    path = Path(run_dir)
    if path.is_dir():
        path = path / "summary.json"
    if not path.is_file():
        raise UsageError(
            f"{run_dir}: no summary.json there", hint="pass a directory written by `dflash-trt bench sweep`"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UsageError(
            f"{path}: not JSON ({exc.msg})", hint="pass a summary.json written by `bench sweep`"
        ) from None
    if not isinstance(data, dict) or "points" not in data:
        raise UsageError(
            f"{path}: not a sweep summary (no `points`)", hint="pass a directory written by `bench sweep`"
        )
    return data


__all__ = ["PointSpec", "SweepConfig", "load_summary", "run_sweep"]
