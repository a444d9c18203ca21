# SPDX-License-Identifier: Apache-2.0
"""Start a real `tritonserver` for a bundle: the binary on PATH (NGC containers), or else the one
inside the PyPI wheel `nvidia-pytriton`.

For the wheel's binary (facts checked on Debian 12 / Python 3.11, tritonserver 2.51):
- a backend directory is assembled in a temporary directory: the wheel's python backend plus the
  `triton_python_backend_stub` built for *this* interpreter's major.minor;
- LD_LIBRARY_PATH puts the interpreter's LIBDIR first (else the stub may load a different
  libpython), then the wheel's bundled libraries;
- PATH starts with this interpreter's bin directory (the stub takes its Python prefix from the
  first python3 on PATH).
The server runs in its own process group, so stopping it takes its Python stub processes along.

Supervision (what `dflash-trt serve` builds on):
- `dead_stubs()` names Python-backend stubs that died (say `kill -9`): Triton itself keeps reporting
  ready and answers every request 400 "Stub process ... is not healthy", so the supervisor must act;
- `heartbeat_age()`: the model touches a heartbeat file from its event loop every second while its
  engine serves; a stale one means a wedged stub (stopped, deadlocked), which Triton does not notice
  either;
- `engine_death()`: the cause the model wrote to `engine-dead` once its engine died (the engine
  thread raised or wedged); Triton keeps reporting ready, and every request gets UNAVAILABLE;
- `drain(budget)` ends a server gracefully: it writes `drain` into the control directory (the model
  then refuses new requests with 503 and ends what is left at the budget with an explicit error),
  unloads the models (readiness turns false at once; Triton finalizes a model when its last request
  has ended and no client stream holds it), waits for the model's `drained` or `finalized` marker,
  then stops the process (SIGTERM; SIGKILL after the exit timeout, when an idle gRPC stream keeps
  tritonserver from exiting: by then every request has ended explicitly). Unloading needs
  explicit model control, so a server with `control_dir` set runs with `--model-control-mode=explicit`
  and a model-repository API restricted by a random key only this object knows.

API key (`api_key`): every endpoint group but health (and model-repository, which the admin key
guards when `control_dir` is set) is restricted to `Authorization: Bearer <key>` on HTTP and to
`triton-grpc-protocol-authorization: Bearer <key>` on gRPC (PROTECTED_APIS; Triton answers 403 /
UNAVAILABLE without it). Health and readiness (`/v2/health/*`, `/v2/models/<m>/ready`, gRPC
ServerLive/ServerReady/ModelReady) and the metrics port stay open for probes and Prometheus.
tritonserver 2.51 takes such keys only as command-line flags, so the key is in tritonserver's
/proc/<pid>/cmdline (a container keeps it from other users; docs/serving.md); the key is never
written to the log, and the environment variable that may carry it is not passed on.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from dflash_trt.errors import DFlashTrtError, EnvironmentMissing
from dflash_trt.utils.api_key import ENV_VAR as API_KEY_ENV
from dflash_trt.utils.api_key import HTTP_HEADER, ApiKey


@dataclass
class TritonInstall:
    binary: Path
    backend_dir: Path | None  # None: the binary's default (NGC images)
    env: dict[str, str]
    source: str  # "PATH" | "nvidia-pytriton"
    tmpdir: tempfile.TemporaryDirectory | None = None


def locate_tritonserver() -> TritonInstall:
    on_path = shutil.which("tritonserver")
    if on_path and os.environ.get("DFLASH_TRT_USE_PYTRITON") != "1":
        return TritonInstall(Path(on_path), None, {}, "PATH")
    purelib = Path(sysconfig.get_paths()["purelib"])
    root = purelib / "pytriton" / "tritonserver"
    binary = root / "bin" / "tritonserver"
    if not binary.is_file():
        raise EnvironmentMissing(
            "no tritonserver: not on PATH and the nvidia-pytriton wheel is not installed",
            hint="pip install 'dflash-trt[serve]' (nvidia-pytriton), or run inside an NGC Triton container",
        )
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / ver / "triton_python_backend_stub"
    if not stub.is_file():
        raise EnvironmentMissing(f"nvidia-pytriton has no Python backend stub for Python {ver}",
                                 hint="use Python 3.8-3.13")  # fmt: skip
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        raise EnvironmentMissing(
            "this Python is not a shared build; the Triton Python stub needs libpython",
            hint="use a Python built with --enable-shared (pyenv: PYTHON_CONFIGURE_OPTS=--enable-shared)",
        )
    tmp = tempfile.TemporaryDirectory(prefix="dflash-triton-backends-")
    backends = Path(tmp.name)
    shutil.copytree(root / "backends", backends, dirs_exist_ok=True)
    shutil.copy2(stub, backends / "python" / "triton_python_backend_stub")
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    libs = [p for p in (libdir, str(purelib / "nvidia_pytriton.libs")) if p]
    env = {
        "LD_LIBRARY_PATH": os.pathsep.join([*libs, os.environ.get("LD_LIBRARY_PATH", "")]).rstrip(os.pathsep),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    }
    return TritonInstall(binary, backends, env, "nvidia-pytriton", tmp)


STUB_PROGRAM = "triton_python_backend_stub"


def scan_stubs(parent: int) -> tuple[dict[int, str], set[int]]:
    """One pass over /proc: the Python-backend stubs whose parent is `parent`. Returns the live ones
    (pid -> the model.py they run, from the command line) and the dead, unreaped ones (zombies: no
    command line left, so they are known by their 15-character kernel name, `comm`)."""
    alive: dict[int, str] = {}
    zombies: set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_bytes()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        head, _, tail = stat.rpartition(b")")
        comm = head.partition(b"(")[2]
        state, ppid = tail.split()[:2]
        if int(ppid) != parent:
            continue
        if state in (b"Z", b"X"):
            if comm == STUB_PROGRAM[:15].encode():
                zombies.add(int(entry))
        elif cmd[0].endswith(STUB_PROGRAM.encode()) and len(cmd) > 1:
            alive[int(entry)] = cmd[1].decode(errors="replace")
    return alive, zombies


ADMIN_HEADER = "dflash-trt-admin"
# Triton's endpoint groups that the API key guards: all but `health` (probes) and
# `model-repository` (the admin key's, or the API key's when there is no admin key).
PROTECTED_APIS = ("inference", "metadata", "model-config", "statistics", "shared-memory", "trace", "logging")


@dataclass
class TritonServer:
    """A running tritonserver. Use as a context manager, or call start()/stop()."""

    model_repository: Path
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    log_verbose: int = 0
    extra_env: dict[str, str] = field(default_factory=dict)
    forward_logs: bool = True
    exit_timeout: int = 30  # --exit-timeout-secs: what Triton itself waits after SIGTERM
    control_dir: Path | None = None  # drain/finalized markers shared with the model (see drain())
    models: tuple[str, ...] = ("tensorrt_llm",)  # loaded explicitly when control_dir is set
    proc: subprocess.Popen | None = None
    install: TritonInstall | None = None
    logs: deque = field(default_factory=lambda: deque(maxlen=200))
    stub_pids: dict[int, str] = field(default_factory=dict)  # pid -> model.py path, taken by watch_stubs()
    admin_key: str = field(default_factory=lambda: secrets.token_hex(16), repr=False)
    api_key: ApiKey | None = None  # clients must send it to every endpoint group but health

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def command(self) -> list[str]:
        assert self.install is not None
        cmd = [
            str(self.install.binary),
            f"--model-repository={self.model_repository}",
            f"--http-address={self.host}",
            f"--http-port={self.http_port}",
            f"--grpc-address={self.host}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.host}",
            f"--metrics-port={self.metrics_port}",
            "--allow-metrics=true",
            "--allow-cpu-metrics=true",
            f"--log-verbose={self.log_verbose}",
            f"--exit-timeout-secs={int(self.exit_timeout)}",
        ]
        if self.control_dir is not None:
            cmd += [
                "--model-control-mode=explicit",
                *(f"--load-model={m}" for m in self.models),
                f"--http-restricted-api=model-repository:{ADMIN_HEADER}={self.admin_key}",
                f"--grpc-restricted-protocol=model-repository:{ADMIN_HEADER}={self.admin_key}",
            ]
        if self.api_key is not None:
            groups = ",".join(
                PROTECTED_APIS if self.control_dir is not None else (*PROTECTED_APIS, "model-repository")
            )
            rule = f"{groups}:{HTTP_HEADER.lower()}={self.api_key.bearer}"
            cmd += [f"--http-restricted-api={rule}", f"--grpc-restricted-protocol={rule}"]
        if self.install.backend_dir is not None:
            cmd.append(f"--backend-directory={self.install.backend_dir}")
        return cmd

    def start(self) -> TritonServer:
        """Start the server in its own process group. It is also stopped when this Python process
        exits normally (atexit), so an exception between start() and stop() leaves no stray
        tritonserver or Python stub behind."""
        self.install = locate_tritonserver()
        env = {**os.environ, **self.install.env, **self.extra_env}
        env.pop(API_KEY_ENV, None)  # tritonserver and the model have no use for it
        if self.control_dir is not None:
            Path(self.control_dir).mkdir(parents=True, exist_ok=True)
            for name in ("drain", "drained", "finalized", "heartbeat", "engine-dead"):
                (Path(self.control_dir) / name).unlink(missing_ok=True)
            env["DFLASH_TRT_CONTROL_DIR"] = str(self.control_dir)
        self.proc = subprocess.Popen(
            self.command(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # own process group: stop() reaches the Python stubs too
            text=True,
            bufsize=1,
        )
        threading.Thread(target=self._pump, daemon=True).start()
        atexit.register(self.stop)
        return self

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.logs.append(line.rstrip())
            if self.forward_logs:
                sys.stderr.write(f"[tritonserver] {line}")
                sys.stderr.flush()

    def wait_ready(self, timeout: float = 300.0) -> float:
        """Poll /v2/health/ready; returns seconds waited. Raises with the last log lines on failure."""
        assert self.proc is not None
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise DFlashTrtError(
                    f"tritonserver exited with code {self.proc.returncode} before it was ready; "
                    + _failure_summary(list(self.logs)),
                    hint="check the model repository and the server log above",
                )
            try:
                with urllib.request.urlopen(f"{self.http_url}/v2/health/ready", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() - t0 > timeout:
                self.stop()
                raise DFlashTrtError(
                    f"tritonserver was not ready after {timeout:.0f} s; " + _failure_summary(list(self.logs)),
                    hint="raise --ready-timeout for large models, or check the log for a load error",
                )
            time.sleep(0.25)

    # --- supervision ------------------------------------------------------------------------------
    def watch_stubs(self) -> dict[int, str]:
        """Remember the stubs running now (call once the server is ready); returns them."""
        if self.proc is not None:
            self.stub_pids = scan_stubs(self.proc.pid)[0]
        return dict(self.stub_pids)

    def dead_stubs(self) -> dict[int, str]:
        """The stubs that are gone (killed, crashed): pid -> model.py. Those remembered by watch_stubs()
        and no longer alive, and any unreaped one (a zombie named as a stub): Triton does not reap a stub
        that dies under it, so one that died even before watch_stubs() looked is found too."""
        if self.proc is None:
            return {}
        alive, zombies = scan_stubs(self.proc.pid)
        dead = {pid: model for pid, model in self.stub_pids.items() if pid not in alive}
        dead.update({pid: self.stub_pids.get(pid, "model.py unknown") for pid in zombies})
        return dead

    def heartbeat_age(self) -> float | None:
        """Seconds since the model last touched its heartbeat (None: no control dir, or none yet)."""
        if self.control_dir is None:
            return None
        try:
            return time.time() - (Path(self.control_dir) / "heartbeat").stat().st_mtime
        except OSError:
            return None

    def engine_death(self) -> str | None:
        """Why the model's engine died (what it wrote to `engine-dead`), or None while it serves."""
        if self.control_dir is None:
            return None
        try:
            return (Path(self.control_dir) / "engine-dead").read_text().strip() or "unknown cause"
        except OSError:
            return None

    def _admin(self, path: str, timeout: float = 5.0) -> None:
        req = urllib.request.Request(
            f"{self.http_url}{path}",
            data=json.dumps({}).encode(),
            headers={ADMIN_HEADER: self.admin_key, "Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()

    def drain(self, budget: float, *, grace: float = 15.0) -> tuple[str, float]:
        """Drain, then stop (see the module docstring). Returns (outcome, seconds): outcome is
        "finalized" (Triton unloaded the model), "drained" (the model ended every request and shut its
        engine down, but Triton still held it: an open client stream) or "timeout" (the model did not
        report back within budget + grace). The process is stopped in every case."""
        t0 = time.monotonic()
        if self.proc is None or self.proc.poll() is not None or self.control_dir is None:
            self.stop()
            return "timeout", time.monotonic() - t0
        control = Path(self.control_dir)
        tmp = control / ".drain.tmp"
        tmp.write_text(f"{budget:g}\n")
        os.replace(tmp, control / "drain")
        for model in self.models:
            try:
                self._admin(f"/v2/repository/models/{model}/unload")
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
                self.logs.append(f"[dflash-trt] unload of {model} failed: {exc}")
        finalized, drained = control / "finalized", control / "drained"
        deadline = t0 + budget + grace
        while time.monotonic() < deadline and self.proc.poll() is None:
            if finalized.exists():
                break
            if drained.exists():  # give Triton a moment to finalize (no client stream holds it)
                settle = time.monotonic() + 1.0
                while not finalized.exists() and time.monotonic() < settle:
                    time.sleep(0.05)
                break
            time.sleep(0.05)
        outcome = "finalized" if finalized.exists() else "drained" if drained.exists() else "timeout"
        # Nothing is in flight now: Triton's exit timeout only bounds its wait for idle connections.
        # Past it (plus a little), what holds the process is an idle gRPC stream: kill it.
        self.stop(timeout=self.exit_timeout + 3.0)
        return outcome, time.monotonic() - t0

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGTERM the process group, wait (default: Triton's exit timeout + 10 s), then SIGKILL what
        is left. Idempotent."""
        proc = self.proc
        if proc is None:
            return None
        if timeout is None:
            timeout = self.exit_timeout + 10.0
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=timeout)
        with contextlib.suppress(ProcessLookupError, PermissionError):  # stragglers (stubs) in the group
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        atexit.unregister(self.stop)
        if self.install is not None and self.install.tmpdir is not None:
            self.install.tmpdir.cleanup()
            self.install.tmpdir = None
        return proc.returncode

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def kill(self) -> int | None:
        """SIGKILL the whole process group at once (a dead stub leaves nothing worth draining)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        return self.stop(timeout=5)


def _failure_summary(lines: list[str]) -> str:
    """What to show of the server log when it failed to come up: the model's load error (Triton's
    "failed to load" line, which carries the exception's message) and the last lines."""
    load = [line for line in lines if re.search(r"failed to load '[^']*' version \d+: ", line)][-1:]
    return "; ".join([*(f"model load error: {line.strip()}" for line in load),
                      "last log lines: " + " | ".join(lines[-8:])])  # fmt: skip
