# SPDX-License-Identifier: Apache-2.0
"""Compiling an engine's rounds in a process of its own, while the engine serves eagerly.

A cold compile of every shape class takes minutes on a small CPU (about five for `tiny`'s twelve
classes on 2 cores, side by side). Rather than keep a server unready that long, `LLM` starts this
module as a child process when the compile cache lacks a class the warm-up needs: the child builds
the same engine (same models, sizes and dtype, so the same fingerprint, engine/compile.py), compiles
every warm-up class and saves it into the cache; the serving engine runs those classes eagerly until
each one appears on disk, then loads it (`RoundCache.refresh`) and runs it compiled. The child runs at a lower CPU priority, ends
with its parent, and holds a lock on the cache directory so that two servers of one bundle do not
compile the same classes twice. Its log is `precompile.log` in that directory.

Side by side. One class compiles on about one core (inductor's Python code generation, with its g++
runs beside it), so the warm-up's classes are shared among several processes (`compile_workers`:
one per core, at most one per warm-up batch, and as many as the free memory holds copies of the
engine). The compiler started above, and `dflash-trt precompile` or a foreground compile, start
`helpers` that build the same engine; every process then walks the warm-up in its order and takes
the next batch no other process has claimed (a file created exclusively in the cache directory:
`Claims`), so the classes arrive in the warm-up's order and the shares balance themselves. The
starter waits for its helpers, then loads what they saved (and compiles what a failed helper left).
The helpers run at the lower priority and end with their parent. $DFLASH_TRT_COMPILE_WORKERS sets
the number of processes (1: no helpers).

    python -m dflash_trt.engine.precompile REQUEST.json                (what LLM starts)
    python -m dflash_trt.engine.precompile REQUEST.json --claims TOKEN (a helper)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from dflash_trt.utils.child import child_env, module_command

log = logging.getLogger(__name__)

LOCK_NAME = ".precompile.lock"
LOG_NAME = "precompile.log"
REQUEST_NAME = "precompile-request.json"
NICENESS = 10  # below the serving process: its rounds come first
WORKERS_ENV = "DFLASH_TRT_COMPILE_WORKERS"  # processes that compile side by side (default: compile_workers)


@dataclasses.dataclass(frozen=True)
class PrecompileRequest:
    """Everything the child needs to build the same engine as its parent (JSON-serialisable)."""

    target_dir: str
    drafter_dir: str | None
    spec: dict[str, Any] | None  # the speculative config (DFlashDecodingConfig.to_dict())
    engine: dict[str, Any]  # EngineConfig fields
    device: str
    dtype: str
    cpu_threads: int | None
    compile_root: str  # the machine's directory under the compile cache root (engine/compile.py)
    eos_token_ids: tuple[int, ...]
    gemm_threads: int = 0  # layers/cpu_gemm's own count (its prefill compiles under it: `all_cores`)


def spawn(request: PrecompileRequest, directory: Path) -> subprocess.Popen[bytes] | None:
    """Start the child that compiles into `directory` (the rounds' fingerprint directory); None when
    another process holds its lock (it is compiling these classes already)."""
    directory.mkdir(parents=True, exist_ok=True)
    if _locked(directory):
        log.info("compiled rounds: another process is compiling into %s; waiting for its results", directory)
        return None
    proc = _launch(_write_request(request, directory), directory)
    log.info(
        "compiled rounds: compiling in the background (pid %d, log %s); rounds run eagerly until each "
        "shape class is ready",
        proc.pid,
        directory / LOG_NAME,
    )
    return proc


def compile_workers(batches: int, rss_bytes: int | None = None) -> int:
    """How many processes compile a warm-up of `batches` throwaway batches side by side:
    $DFLASH_TRT_COMPILE_WORKERS, else one per CPU core this process may use (its affinity and its
    cgroup's CPU quota: a pod's limit), at most one per batch, and no more than the available memory
    (the machine's, or what the cgroup's limit leaves) holds copies of this process (`rss_bytes`,
    default its resident size; each helper builds the same engine). At least 1."""
    from dflash_trt.errors import ConfigError

    if raw := os.environ.get(WORKERS_ENV):
        try:
            n = int(raw)
        except ValueError:
            n = 0
        if n < 1:
            raise ConfigError(WORKERS_ENV, raw, "must be an integer >= 1", hint="1 compiles in one process")
        return min(n, max(1, batches))
    cap = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if (quota := _cgroup_cpus()) is not None:
        cap = min(cap, quota)
    available, rss = _memory(rss_bytes)
    if available is not None and rss:
        cap = min(cap, 1 + int(0.8 * available) // rss)  # this process plus the helpers that fit
    return max(1, min(cap, batches))


CGROUP = Path("/sys/fs/cgroup")  # cgroup v2's unified hierarchy, as a container sees its own group


def _cgroup_cpus(root: Path = CGROUP) -> int | None:
    """The cgroup's CPU quota in whole cores (cpu.max "quota period", rounded up), None without one."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else max(1, -(-int(quota) // int(period)))
    except (OSError, ValueError):
        return None


def _memory(rss_bytes: int | None, root: Path = CGROUP) -> tuple[int | None, int]:
    """(available bytes, this process's resident bytes or `rss_bytes`). Available: MemAvailable, or
    less where the cgroup's memory.max leaves less (a container's /proc/meminfo shows the host's);
    None where neither answers."""
    rss = rss_bytes
    available = None
    try:
        if rss is None:
            rss = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit != "max":
            left = int(limit) - int((root / "memory.current").read_text())
            available = left if available is None else min(available, left)
    except (OSError, ValueError):
        pass
    return available, rss or 0


class Claims:
    """Which warm-up batches a compile session's processes have taken: batch n is claimed by creating
    `.claim-<token>-<n>` in the cache directory exclusively (the first process to create it runs
    it). A new session has a new token; `release` removes the session's files."""

    def __init__(self, directory: Path, token: str | None = None) -> None:
        self.directory = directory
        self.token = token or uuid.uuid4().hex[:12]

    def __call__(self, n: int) -> bool:
        try:
            os.close(
                os.open(self.directory / f".claim-{self.token}-{n}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            )
        except FileExistsError:
            return False
        return True

    def release(self) -> None:
        for path in self.directory.glob(f".claim-{self.token}-*"):
            path.unlink(missing_ok=True)


def helpers(request: PrecompileRequest, claims: Claims, workers: int) -> list[subprocess.Popen[bytes]]:
    """Start workers - 1 processes that compile the warm-up batches they claim into the claims'
    directory (the caller claims its own, then waits for them: `wait_helpers`)."""
    if workers <= 1:
        return []
    directory = claims.directory
    req_path = _write_request(request, directory)
    procs = [_launch(req_path, directory, claims.token) for _ in range(1, workers)]
    log.info("compiled rounds: %d processes compile side by side (helpers %s; log %s)", workers,
             ", ".join(str(p.pid) for p in procs), directory / LOG_NAME)  # fmt: skip
    return procs


def wait_helpers(procs: list[subprocess.Popen[bytes]]) -> None:
    """Wait for every helper; one that failed only leaves its classes to the caller (logged)."""
    for proc in procs:
        if proc.wait() != 0:
            log.warning("compiled rounds: helper %d exited with %d; its classes compile here", proc.pid,
                        proc.returncode)  # fmt: skip


def _write_request(request: PrecompileRequest, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    req_path = directory / REQUEST_NAME
    tmp = req_path.with_name(f".{req_path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(dataclasses.asdict(request), indent=1))
    os.replace(tmp, req_path)
    return req_path


def _launch(req_path: Path, directory: Path, claims: str | None = None) -> subprocess.Popen[bytes]:
    """A compiler process (with a claims token: a helper) with its output appended to the directory's log."""
    args = module_command(
        "dflash_trt.engine.precompile", str(req_path), *(("--claims", claims) if claims else ())
    )
    with open(directory / LOG_NAME, "ab") as out:
        return subprocess.Popen(
            args,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=_child_setup,
            env=child_env(PYTHONUNBUFFERED="1"),
        )


def _child_setup() -> None:  # pragma: no cover - runs in the child between fork and exec
    os.nice(NICENESS)
    with contextlib.suppress(Exception):  # Linux: end with the parent (a server that exits)
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _locked(directory: Path) -> bool:
    """Whether a live process holds the directory's compile lock."""
    import fcntl

    with open(directory / LOCK_NAME, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


def run(request: PrecompileRequest, claims: str | None = None) -> int:
    """Build the engine and compile (or find) every warm-up class, sharing them with helpers; a
    helper (`claims`: its session's token) compiles the batches it claims. Returns how many this
    process compiled."""
    import fcntl

    import torch

    from dflash_trt.engine.assemble import build_engine
    from dflash_trt.engine.compile import point_inductor_at
    from dflash_trt.engine.config import EngineConfig
    from dflash_trt.layers import cpu_gemm
    from dflash_trt.spec.decoding_config import DFlashDecodingConfig
    from dflash_trt.utils.device import DTYPES

    point_inductor_at(request.compile_root, cpu=torch.device(request.device).type == "cpu")
    if request.cpu_threads is not None:
        torch.set_num_threads(request.cpu_threads)
    cpu_gemm.set_threads(request.gemm_threads)
    config = EngineConfig(**request.engine)
    assert config.compile and config.compile_dir is not None
    t0 = time.perf_counter()
    with torch.inference_mode():
        engine = build_engine(
            target_dir=request.target_dir,
            drafter_dir=request.drafter_dir,
            spec=DFlashDecodingConfig.from_any(request.spec) if request.spec is not None else None,
            tokenizer=None,
            config=config,
            device=torch.device(request.device),
            dtype=DTYPES[request.dtype],
            eos_token_ids=request.eos_token_ids,
        )
        rounds = engine.executor.rounds
        assert rounds is not None and rounds.directory is not None
        if claims is not None:  # a helper: its parent holds the lock
            engine.warm_up(Claims(rounds.directory, claims))
        else:
            with open(rounds.directory / LOCK_NAME, "a+") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # the parent saw it free; a sibling may have taken it since
                warm_up_shared(engine, request, rounds.directory)
    log.info(
        "compiled rounds%s: %d compiled, %d already there, in %.1f s%s",
        "" if claims is None else " (a helper)",
        rounds.compiled + rounds.helped,
        rounds.loaded - rounds.helped,
        time.perf_counter() - t0,
        f" ({rounds.helped} of them by helpers)" if rounds.helped else "",
    )
    return rounds.compiled


def warm_up_shared(engine: Any, request: PrecompileRequest, directory: Path) -> float:
    """`engine.warm_up()` with its classes compiled by `compile_workers` processes side by side: this
    one's share, then (once the helpers are done) the whole warm-up, which loads what they saved (a
    damaged artifact is compiled again) and compiles what a failed helper left. Returns the seconds
    it took."""
    t0 = time.perf_counter()
    rounds = engine.executor.rounds
    classes = engine.warm_up_classes()
    missing = sum(not rounds.on_disk([k]) for k in classes)
    compiled = rounds.compiled
    workers = compile_workers(engine.warm_up_size()) if missing else 1
    claims = Claims(directory)
    procs = helpers(request, claims, workers)
    try:
        if procs:
            engine.warm_up(claims)
    except BaseException:  # a failed or interrupted compile: the helpers' shares are not wanted either
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait()
        procs = []
        raise
    finally:
        wait_helpers(procs)
        claims.release()
    engine.warm_up()
    rounds.helped += max(0, missing - (rounds.compiled - compiled))
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    claims = None
    if len(args) == 3 and args[1] == "--claims" and args[2].isalnum():
        args, claims = args[:1], args[2]
    if len(args) != 1:
        print("usage: python -m dflash_trt.engine.precompile REQUEST.json [--claims TOKEN]", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    data = json.loads(Path(args[0]).read_text())
    data["eos_token_ids"] = tuple(data["eos_token_ids"])
    run(PrecompileRequest(**data), claims)
    return 0


if __name__ == "__main__":
    sys.exit(main())
