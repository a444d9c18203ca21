# SPDX-License-Identifier: Apache-2.0
"""Fixtures of the benchmark-harness tests: byte-level tokenizers and the scripted server.

The scripted server counts every UTF-8 byte of a prompt as one token and emits one ASCII
character per output token, so a byte-level tokenizer agrees with it exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

# A minimal chat template: the user's content between fixed markers (7 + 12 bytes of overhead).
CHAT_TEMPLATE = "{% for m in messages %}<user>{{ m['content'] }}</user>{% endfor %}{% if add_generation_prompt %}<asst>{% endif %}"


@pytest.fixture(scope="session")
def byte_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dflash_trt.tiny import build_byte_tokenizer

    path = tmp_path_factory.mktemp("byte-tokenizer")
    build_byte_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def chat_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dflash_trt.tiny import build_byte_tokenizer

    path = tmp_path_factory.mktemp("chat-tokenizer")
    tok = build_byte_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def byte_tokenizer(byte_tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(byte_tokenizer_dir)


@pytest.fixture
def scripted() -> Callable[..., Any]:
    """`with scripted(Script(...)) as server:` runs a scripted server on 127.0.0.1 (free ports)."""
    from tests.bench.scripted_server import ScriptedServerThread

    @contextmanager
    def run(script: Any = None, **kwargs: Any) -> Iterator[Any]:
        with ScriptedServerThread(script, **kwargs) as server:
            yield server

    return run


def url_for(server: Any, protocol: str) -> str:
    return server.grpc_url if protocol == "triton-grpc" else server.http_url


TRITON_REPO = Path(__file__).parent / "triton_repo"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A real tritonserver (from nvidia-pytriton) serving tests/bench/triton_repo on 127.0.0.1.

    The repository's `tensorrt_llm` is a decoupled Python model with our I/O contract and a fixed
    schedule, so the clients are checked against Triton's own HTTP SSE and gRPC framing.
    """
    import importlib.util
    import os
    import shutil
    import subprocess
    import sys
    import sysconfig
    import time
    import urllib.request

    if importlib.util.find_spec("pytriton") is None:
        raise RuntimeError("nvidia-pytriton (the serve extra, part of the dev install) is not installed")
    site = Path(sysconfig.get_paths()["purelib"])
    server_dir = site / "pytriton" / "tritonserver"
    backends = tmp_path_factory.mktemp("triton-backends")
    shutil.copytree(server_dir / "backends" / "python", backends / "python")
    stub = (
        server_dir
        / "python_backend_stubs"
        / f"{sys.version_info.major}.{sys.version_info.minor}"
        / "triton_python_backend_stub"
    )
    shutil.copy2(stub, backends / "python" / "triton_python_backend_stub")
    http, grpc, metrics = _free_port(), _free_port(), _free_port()
    env = dict(os.environ)
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (libdir, str(site / "nvidia_pytriton.libs"), env.get("LD_LIBRARY_PATH", "")) if p
    )
    env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
    log = tmp_path_factory.mktemp("triton-log") / "tritonserver.log"
    cmd = [
        str(server_dir / "bin" / "tritonserver"),
        f"--model-repository={TRITON_REPO}",
        f"--backend-directory={backends}",
        "--http-address=127.0.0.1", f"--http-port={http}",
        "--grpc-address=127.0.0.1", f"--grpc-port={grpc}",
        "--metrics-address=127.0.0.1", f"--metrics-port={metrics}",
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/ready", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tritonserver did not become ready:\n{log.read_text()[-4000:]}")
            time.sleep(0.25)
        yield {"http_url": f"http://127.0.0.1:{http}", "grpc_url": f"127.0.0.1:{grpc}", "log": str(log)}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
