# SPDX-License-Identifier: Apache-2.0
"""`dflash-trt serve`: a real Triton Inference Server for a bundle."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from dflash_trt.cli._api_key import api_key_from_options, api_key_options

if TYPE_CHECKING:
    from dflash_trt.openai_front.app import FrontThread
    from dflash_trt.triton.server import TritonServer

# Triton's own --exit-timeout-secs. serve drains before it signals tritonserver, so this only bounds
# how long Triton waits for idle HTTP keep-alive connections (it waits for every open connection).
EXIT_TIMEOUT_S = 1
WATCH_PERIOD_S = 0.25
HEARTBEAT_TIMEOUT_S = 10.0  # the model beats every second: this much silence is a wedged stub


@click.command()
@click.option(
    "--bundle", required=True, type=click.Path(file_okay=False, path_type=Path), help="Bundle directory."
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0 for all).")
@click.option("--http-port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--grpc-port", type=click.IntRange(1, 65535), default=8001, show_default=True)
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=8002, show_default=True)
@click.option("--ready-timeout", type=click.FloatRange(min=1), default=600, show_default=True,
              help="Seconds to wait for the model to load.")  # fmt: skip
@click.option(
    "--no-draft", is_flag=True, help="Serve the bundle's target without the drafter (the AR baseline)."
)
@click.option(
    "--compile/--eager",
    "compile_rounds",
    default=None,
    help="Embedded engine: compiled rounds (torch.compile; the default wherever it can run, a compile "
    "failure falls back to eager with a warning) or eager rounds. Compiling takes minutes on a small CPU "
    "the first time; the cache under <bundle>/compile-cache makes restarts take seconds.  [default: compile]",
)
@click.option("--drain-timeout", type=click.FloatRange(min=0), default=30, show_default=True,
              help="On SIGTERM/SIGINT: seconds in-flight requests may run on before they are ended with an "
              "explicit error (new requests are refused at once). Keep it below the orchestrator's grace "
              "period minus any preStop delay.")  # fmt: skip
@click.option("--log-verbose", type=click.IntRange(0, 3), default=0, show_default=True)
@click.option("--quiet", is_flag=True, help="Do not forward the server log to stderr.")
@click.option(
    "--openai-port",
    type=click.IntRange(1, 65535),
    default=None,
    help="Also serve OpenAI-compatible /v1/completions, /v1/chat/completions and /v1/models on this port "
    "(off by default; 9000 is the usual choice). Forwards to the model over Triton gRPC.",
)
@click.option(
    "--openai-model-name",
    metavar="NAME",
    help="Model id of the OpenAI endpoints [default: the bundle's name].",
)
@click.option(
    "--triton-url",
    metavar="HOST:PORT",
    help="With --openai-port: front an already running Triton's gRPC endpoint instead of starting "
    "tritonserver (the Helm chart's sidecar).",
)
@api_key_options(role="require on inference and metadata (HTTP, gRPC, OpenAI /v1)")
def serve(
    bundle: Path, host: str, http_port: int, grpc_port: int, metrics_port: int, ready_timeout: float,
    no_draft: bool, compile_rounds: bool | None, drain_timeout: float, log_verbose: int, quiet: bool,
    openai_port: int | None, openai_model_name: str | None, triton_url: str | None, api_key: str | None,
    api_key_file: Path | None,
) -> None:  # fmt: skip
    """Start tritonserver on the bundle's model repository and supervise it until Ctrl-C / SIGTERM.

    SIGTERM (or Ctrl-C) drains: readiness turns false and new requests are refused at once, in-flight
    requests run on for up to --drain-timeout seconds and whatever is left then ends with an explicit
    error; the model is finalized and serve exits 0. A second signal kills the server at once. If the
    engine dies (its thread raises, or makes no progress for the LLM's wedge_timeout_s), every request
    in flight ends with an explicit error naming the cause, new ones are refused, and serve stops the
    server and exits 1. So it does within a second when a Python-backend stub dies (say `kill -9`), and
    within 10 s when a stub is wedged and its heartbeat stops: a supervisor (Kubernetes, systemd) then
    restarts it.

    Uses the `tritonserver` on PATH (NGC images) or else the binary inside the nvidia-pytriton
    wheel, so it runs for real on a CPU machine with a `torch` (embedded engine) bundle.

    With --openai-port the OpenAI-compatible front runs in this process next to tritonserver
    (docs/serving.md, "OpenAI-compatible endpoints").

    With an API key (--api-key-file, $DFLASH_TRT_API_KEY or --api-key) clients must send
    `Authorization: Bearer KEY` (Triton gRPC: `triton-grpc-protocol-authorization: Bearer KEY`);
    health, readiness and metrics stay open (docs/serving.md, "API keys").

    \b
    Example:
      dflash-trt build --target tiny --output /tmp/tiny && dflash-trt serve --bundle /tmp/tiny
      dflash-trt serve --bundle /tmp/tiny --openai-port 9000
      dflash-trt serve --bundle /tmp/tiny --host 0.0.0.0 --api-key-file /etc/dflash-trt/api-key
    """
    from dflash_trt.bundle import load_manifest

    _check_ports(http_port, grpc_port, metrics_port, openai_port, openai_model_name, triton_url)
    key = api_key_from_options(api_key, api_key_file)
    _announce_key(key, host)
    manifest = load_manifest(bundle)
    _check_compile(manifest, compile_rounds=compile_rounds)
    front_args = (bundle, manifest, host, grpc_port, openai_port, openai_model_name, triton_url, key)
    make_front = functools.partial(_openai_front, *front_args) if openai_port is not None else None
    if triton_url is not None:
        assert make_front is not None
        _front_only(make_front())
        return
    with tempfile.TemporaryDirectory(prefix="dflash-serve-") as tmp:
        server = _triton_server(bundle, manifest, Path(tmp), host=host, ports=(http_port, grpc_port, metrics_port),
                                log_verbose=log_verbose, quiet=quiet, no_draft=no_draft,
                                compile_rounds=compile_rounds, key=key)  # fmt: skip
        outcome, code = _supervise(server, make_front, manifest, ready_timeout=ready_timeout,
                                   drain_timeout=drain_timeout, no_draft=no_draft)  # fmt: skip
    # Exit 0 when every request ended explicitly and the engine shut down cleanly. tritonserver itself
    # may have been killed after that (an idle gRPC stream holds it; see TritonServer.drain).
    sys.exit(0 if (outcome == "finalized" and code == 0) or outcome == "drained" else 1)


def _check_compile(manifest: dict, *, compile_rounds: bool | None) -> None:
    from dflash_trt.errors import UsageError

    if compile_rounds and manifest["backend"] != "torch":
        raise UsageError(
            f"--compile needs a bundle for the embedded engine; {manifest['name']} has backend "
            f"{manifest['backend']!r}",
            hint="rebuild with --backend torch, or drop --compile (TensorRT-LLM compiles its own way)",
        )


def _triton_server(
    bundle: Path, manifest: dict, tmp: Path, *, host: str, ports: tuple[int, int, int], log_verbose: int,
    quiet: bool, no_draft: bool, compile_rounds: bool | None, key: Any,
) -> TritonServer:  # fmt: skip
    """tritonserver (not started) on the bundle's repository, or on a copy with --no-draft/--compile/
    --eager. The embedded engine's compile cache goes into the bundle when it is writable."""
    from dflash_trt.bundle import bundle_path
    from dflash_trt.engine.compile import CACHE_ENV, bundle_cache_root
    from dflash_trt.triton.server import TritonServer

    repo = bundle_path(bundle, manifest, "model_repository")
    if no_draft or compile_rounds is not None:
        repo = _with_overrides(repo, tmp, no_draft=no_draft, compile_rounds=compile_rounds)
    http_port, grpc_port, metrics_port = ports
    return TritonServer(
        model_repository=repo.resolve(),
        host=host,
        http_port=http_port,
        grpc_port=grpc_port,
        metrics_port=metrics_port,
        log_verbose=log_verbose,
        extra_env={
            "DFLASH_TRT_BUNDLE_ROOT": str(bundle.resolve()),
            **_compile_cache_env(bundle_cache_root(bundle), CACHE_ENV),
        },
        forward_logs=not quiet,
        exit_timeout=EXIT_TIMEOUT_S,
        control_dir=tmp / "control",
        models=(manifest["serving"]["model_name"],),
        api_key=key,
    )


def _compile_cache_env(root: Path | None, env: str) -> dict[str, str]:
    """The server's environment for the compile cache root (engine/compile.py `bundle_cache_root`):
    nothing when it comes from $<env> already (inherited) or is the engine's default."""
    if root is None or os.environ.get(env):
        return {}
    return {env: str(root.resolve())}


@contextlib.contextmanager
def _signals(handler: Callable[[int, Any], None]) -> Iterator[None]:
    """SIGINT and SIGTERM go to `handler` inside the block; the previous handlers come back after."""
    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


def _supervise(
    server: TritonServer, make_front: Callable[[], FrontThread] | None, manifest: dict, *, ready_timeout: float,
    drain_timeout: float, no_draft: bool,
) -> tuple[str, int | None]:  # fmt: skip
    """Start tritonserver (and the front), watch them until a signal, then drain. Returns the drain's
    outcome and tritonserver's exit code."""
    stop = threading.Event()
    front: FrontThread | None = None

    def on_signal(signum: int, _frame: Any) -> None:
        if stop.is_set():  # a second signal: no more waiting
            click.echo("second signal: killing tritonserver", err=True)
            server.kill()
        stop.set()

    with _signals(on_signal):
        try:
            front = _start(server, make_front, manifest, ready_timeout=ready_timeout, no_draft=no_draft)
            _watch(server, front, stop)
            if front is not None:
                front.stop()  # first: in-flight OpenAI requests finish (or are cancelled) while Triton is up
            click.echo(
                f"draining: new requests refused, in-flight ones get up to {drain_timeout:g} s", err=True
            )
            outcome, took = server.drain(drain_timeout)
            code = server.proc.returncode if server.proc is not None else None
            how = {"finalized": "model finalized", "drained": "model drained (an open client stream kept Triton "
                   "from finalizing it)", "timeout": "model did NOT report drained"}[outcome]  # fmt: skip
            click.echo(f"stopped in {took:.1f} s: {how}, tritonserver exit code {code}", err=True)
        finally:
            if front is not None:
                front.stop()  # idempotent; here for the error paths
            server.stop()
    return outcome, code


def _start(
    server: TritonServer, make_front: Callable[[], FrontThread] | None, manifest: dict, *, ready_timeout: float,
    no_draft: bool,
) -> FrontThread | None:  # fmt: skip
    """tritonserver until the model is ready, the stubs to watch, then the front, which is built (its
    chat template loaded: transformers' import and the tokenizer, ~5 s) while tritonserver loads the
    model. Returns the front."""
    server.start()
    click.echo(f"starting tritonserver ({server.install.source if server.install else '?'}) for "
               f"{manifest['name']} [{manifest['backend']}{', no drafter' if no_draft else ''}]", err=True)  # fmt: skip
    front = make_front() if make_front is not None else None
    waited = server.wait_ready(ready_timeout)
    click.echo(
        f"ready in {waited:.1f} s: HTTP {server.http_url}  gRPC {server.grpc_url}  metrics {server.metrics_url}  "
        f"(model {manifest['serving']['model_name']})",
        err=True,
    )
    if not server.watch_stubs():
        click.echo("warning: found no Python-backend stub process to watch", err=True)
    if front is not None:
        front.start()
        click.echo(
            f"OpenAI-compatible endpoints on {front.url}/v1 (model {front.cfg.served_names[0]})", err=True
        )
    return front


def _announce_key(key, host: str) -> None:
    """Say on stderr what the key protects (never the key), or warn about an open server."""
    if key is not None:
        click.echo(f"API key from {key.source}: required on inference and metadata (HTTP, gRPC, OpenAI /v1); "
                   "health, readiness and metrics stay open", err=True)  # fmt: skip
        if key.source == "--api-key":
            click.echo("note: --api-key shows in process lists; prefer --api-key-file or $DFLASH_TRT_API_KEY",
                       err=True)  # fmt: skip
    elif not (host.startswith("127.") or host in ("localhost", "::1")):
        click.echo(f"warning: --host={host} without an API key: anyone who reaches these ports can run the "
                   "model; pass --api-key-file (docs/serving.md, API keys)", err=True)  # fmt: skip


def _openai_front(bundle, manifest, host, grpc_port, openai_port, model_name, triton_url, key):
    """The OpenAI front's thread (not started)."""
    from dflash_trt.openai_front.app import FrontConfig, FrontThread
    from dflash_trt.openai_front.chat import ChatTemplate, tokenizer_source

    chat = ChatTemplate.load(tokenizer_source(bundle, manifest))
    if not chat.available:
        click.echo(f"note: the tokenizer {chat.source} has no chat template: /v1/chat/completions answers 400",
                   err=True)  # fmt: skip
    local = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    cfg = FrontConfig(
        triton_url=triton_url or f"{local}:{grpc_port}",
        triton_model=manifest["serving"]["model_name"],
        served_names=[model_name or manifest["name"]],
        host=host,
        port=openai_port,
        max_seq_len=(manifest.get("limits") or {}).get("max_seq_len"),
        api_key=key,
    )
    return FrontThread(cfg, chat)


def _front_only(front) -> None:
    """--triton-url: run only the front until SIGINT/SIGTERM."""
    stop = threading.Event()
    with _signals(lambda *_: stop.set()):
        try:
            front.start()
            click.echo(f"OpenAI-compatible endpoints on {front.url}/v1 -> Triton gRPC {front.cfg.triton_url} "
                       f"(model {front.cfg.served_names[0]})", err=True)  # fmt: skip
            while not stop.wait(0.5):
                if not front.alive():
                    raise click.ClickException("the OpenAI front stopped unexpectedly")
            click.echo("stopping the OpenAI front", err=True)
        finally:
            front.stop()


def _check_ports(
    http_port: int,
    grpc_port: int,
    metrics_port: int,
    openai_port: int | None,
    openai_model_name: str | None,
    triton_url: str | None,
) -> None:
    """Refuse flag combinations that cannot work (exit 2), before anything starts."""
    from dflash_trt.errors import UsageError

    if len({http_port, grpc_port, metrics_port}) != 3:
        raise UsageError(
            f"ports must differ: --http-port={http_port} --grpc-port={grpc_port} --metrics-port={metrics_port}"
        )
    if openai_port is not None and triton_url is None and openai_port in (http_port, grpc_port, metrics_port):
        raise UsageError(
            f"--openai-port={openai_port} is taken by Triton (--http-port={http_port} --grpc-port={grpc_port} "
            f"--metrics-port={metrics_port})",
            hint="pick another port, e.g. --openai-port 9000",
        )
    if triton_url is not None and openai_port is None:
        raise UsageError(f"--triton-url={triton_url!r} needs --openai-port", hint="add --openai-port 9000")
    if openai_model_name is not None and openai_port is None:
        raise UsageError(
            f"--openai-model-name={openai_model_name!r} needs --openai-port", hint="add --openai-port 9000"
        )


def _watch(server: TritonServer, front: FrontThread | None, stop: threading.Event) -> None:
    """Until `stop` is set: raise ClickException (exit 1) when tritonserver exits, the model's engine
    dies, a Python stub dies or wedges (its heartbeat stops), or the OpenAI front stops."""
    while not stop.wait(WATCH_PERIOD_S):
        if server.proc is not None and server.proc.poll() is not None:
            raise click.ClickException(f"tritonserver exited unexpectedly with code {server.proc.returncode}")
        if not server.stub_pids:  # none seen at ready: keep looking
            server.watch_stubs()
        dead = server.dead_stubs()
        if dead:
            server.kill()
            pid, model = next(iter(dead.items()))
            raise click.ClickException(
                f"the Python-backend stub (pid {pid}, {model}) died; tritonserver would keep reporting "
                "ready while failing every request, so it was stopped; restart serve"
            )
        cause = server.engine_death()
        if cause is not None:
            # The model has already ended every request with an error. Stop the front (it closes its
            # idle Triton streams), then Triton in order (a zero-budget drain), so that those error
            # responses reach their clients and nothing holds Triton open.
            if front is not None:
                front.stop()
            server.drain(0.0)
            raise click.ClickException(
                f"the engine died ({cause}); every request in flight got an error and new ones were refused, "
                "tritonserver was stopped; restart serve"
            )
        age = server.heartbeat_age()
        if age is not None and age > HEARTBEAT_TIMEOUT_S:
            server.kill()
            raise click.ClickException(
                f"the model's heartbeat is {age:.0f} s old (its Python stub is wedged); tritonserver "
                "would keep reporting ready while requests hang, so it was stopped; restart serve"
            )
        if front is not None and not front.alive():
            raise click.ClickException("the OpenAI front stopped unexpectedly")


def _with_overrides(repo: Path, out: Path, *, no_draft: bool, compile_rounds: bool | None) -> Path:
    """A copy of the repository whose model.yaml drops speculative_config (--no-draft) and/or sets
    compile: true (--compile) or false (--eager)."""
    import shutil

    import yaml

    from dflash_trt.utils.io import dump_yaml

    dest = out / "model_repository"
    shutil.copytree(repo, dest)
    for model_yaml in dest.glob("*/1/model.yaml"):
        cfg = yaml.safe_load(model_yaml.read_text())
        if no_draft:
            cfg.pop("speculative_config", None)
        if compile_rounds is not None:
            cfg["compile"] = compile_rounds
        flags = " ".join(
            f
            for f, on in (
                ("--no-draft", no_draft),
                ("--compile", compile_rounds),
                ("--eager", compile_rounds is False),
            )
            if on
        )
        model_yaml.write_text(f"# {flags} copy written by dflash-trt serve\n" + dump_yaml(cfg))
    return dest
