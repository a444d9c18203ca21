# SPDX-License-Identifier: Apache-2.0
"""Compiling an engine's rounds in a process of its own, while the engine serves eagerly.

A cold compile of every shape class takes minutes on a small CPU (about seven for `tiny`'s twelve
classes on 2 cores). Rather than keep a server unready that long, `LLM` starts this module as a child process
when the compile cache lacks a class the warm-up needs: the child builds the same engine (same models,
sizes and dtype, so the same fingerprint, engine/compile.py), compiles every warm-up class and saves
it into the cache; the serving engine runs those classes eagerly until each one appears on disk, then
loads it (`RoundCache.refresh`) and runs it compiled. The child runs at a lower CPU priority, ends
with its parent, and holds a lock on the cache directory so that two servers of one bundle do not
compile the same classes twice. Its log is `precompile.log` in that directory.

    python -m dflash_trt.engine.precompile REQUEST.json     (what LLM starts)
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
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

LOCK_NAME = ".precompile.lock"
LOG_NAME = "precompile.log"
REQUEST_NAME = "precompile-request.json"
NICENESS = 10  # below the serving process: its rounds come first


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


def spawn(request: PrecompileRequest, directory: Path) -> subprocess.Popen[bytes] | None:
    """Start the child that compiles into `directory` (the rounds' fingerprint directory); None when
    another process holds its lock (it is compiling these classes already)."""
    directory.mkdir(parents=True, exist_ok=True)
    if _locked(directory):
        log.info("compiled rounds: another process is compiling into %s; waiting for its results", directory)
        return None
    req_path = directory / REQUEST_NAME
    tmp = req_path.with_name(f".{req_path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(dataclasses.asdict(request), indent=1))
    os.replace(tmp, req_path)
    with open(directory / LOG_NAME, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dflash_trt.engine.precompile", str(req_path)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=_child_setup,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    log.info(
        "compiled rounds: compiling in the background (pid %d, log %s); rounds run eagerly until each "
        "shape class is ready",
        proc.pid,
        directory / LOG_NAME,
    )
    return proc


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


def run(request: PrecompileRequest) -> int:
    """Build the engine and compile (or find) every warm-up class; returns how many were compiled."""
    import fcntl

    import torch

    from dflash_trt.engine.compile import point_inductor_at
    from dflash_trt.engine.config import EngineConfig
    from dflash_trt.engine.engine import LLMEngine
    from dflash_trt.spec.decoding_config import DFlashDecodingConfig
    from dflash_trt.utils.device import DTYPES

    point_inductor_at(request.compile_root)
    if request.cpu_threads is not None:
        torch.set_num_threads(request.cpu_threads)
    config = EngineConfig(**request.engine)
    assert config.compile and config.compile_dir is not None
    t0 = time.perf_counter()
    with torch.inference_mode():
        engine = LLMEngine(
            target_dir=request.target_dir,
            drafter_dir=request.drafter_dir,
            spec=DFlashDecodingConfig.from_any(request.spec) if request.spec is not None else None,
            tokenizer=None,
            config=config,
            device=torch.device(request.device),
            dtype=DTYPES[request.dtype],
            eos_token_ids=request.eos_token_ids,
        )
        rounds = engine.runner.rounds
        assert rounds is not None and rounds.directory is not None
        with open(rounds.directory / LOCK_NAME, "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the parent saw it free; a sibling may have taken it since
            engine.warm_up()
    log.info(
        "compiled rounds: %d compiled, %d already there, in %.1f s",
        rounds.compiled,
        rounds.loaded,
        time.perf_counter() - t0,
    )
    return rounds.compiled


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m dflash_trt.engine.precompile REQUEST.json", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    data = json.loads(Path(args[0]).read_text())
    data["eos_token_ids"] = tuple(data["eos_token_ids"])
    run(PrecompileRequest(**data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
