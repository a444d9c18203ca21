# SPDX-License-Identifier: Apache-2.0
"""Smoke test of an installed dflash-trt (the serving image, or a fresh venv): build the `tiny`
bundle, `dflash-trt serve` it with an API key from a file and the OpenAI front, check that probes
and metrics answer without the key, that inference needs it (Triton 403, OpenAI 401) and works
with it, then SIGTERM and expect a clean drain (exit 0) and a log without the key.

Standard library only, so it runs on exactly what the image ships. Run from a writable directory:
    python build/docker/image_smoke.py
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def call(url: str, body: dict | None = None, key: str | None = None) -> tuple[int, str]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers=headers, method="POST" if body else "GET")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def expect(what: str, got: tuple[int, str], status: int, needle: str = "") -> None:
    ok = got[0] == status and needle in got[1]
    print(f"{'ok  ' if ok else 'FAIL'} {what}: HTTP {got[0]}", flush=True)
    if not ok:
        raise SystemExit(f"{what}: expected HTTP {status} with {needle!r}, got {got[0]}: {got[1][:300]}")


def main() -> int:
    work = Path.cwd() / "image-smoke"
    work.mkdir(exist_ok=True)
    bundle = work / "tiny"
    subprocess.run(["dflash-trt", "build", "--target", "tiny", "--output", str(bundle), "--force"], check=True,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    key = secrets.token_urlsafe(32)
    key_file = work / "api-key"
    key_file.write_text(key + "\n")
    key_file.chmod(0o600)
    http, grpc, metrics, oai = free_ports(4)
    log = work / "serve.log"
    with log.open("w") as err:
        proc = subprocess.Popen(
            ["dflash-trt", "serve", "--bundle", str(bundle), "--http-port", str(http), "--grpc-port", str(grpc),
             "--metrics-port", str(metrics), "--openai-port", str(oai), "--api-key-file", str(key_file)],
            stderr=err,
        )  # fmt: skip
    base, front = f"http://127.0.0.1:{http}", f"http://127.0.0.1:{oai}"
    try:
        deadline = time.monotonic() + 300
        while not _ready(front):  # the front's readiness: Triton and the model ready, no key needed
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("serve did not become ready:\n" + log.read_text()[-3000:])
            time.sleep(0.5)
        expect("readiness without a key", call(f"{base}/v2/health/ready"), 200)
        expect("liveness without a key", call(f"{base}/v2/health/live"), 200)
        expect("metrics without a key", call(f"http://127.0.0.1:{metrics}/metrics"), 200, "nv_inference")
        gen = {"text_input": "def fibonacci(n):", "sampling_param_max_tokens": 8}
        expect("Triton generate without a key", call(f"{base}/v2/models/tensorrt_llm/generate", gen), 403)
        expect("Triton generate with the key", call(f"{base}/v2/models/tensorrt_llm/generate", gen, key), 200,
               "text_output")  # fmt: skip
        comp = {"model": "tiny", "prompt": "def fibonacci(n):", "max_tokens": 8}
        expect(
            "OpenAI completion without a key", call(f"{front}/v1/completions", comp), 401, "invalid_api_key"
        )
        expect("OpenAI completion with the key", call(f"{front}/v1/completions", comp, key), 200, "choices")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    text = log.read_text()
    if code != 0 or key in text:
        raise SystemExit(f"serve exited {code} (key in log: {key in text}):\n{text[-3000:]}")
    print(f"ok   serve drained and exited 0 (dflash-trt at {sys.prefix}, uid {os.getuid()})", flush=True)
    return 0


def _ready(front: str) -> bool:
    try:
        return call(f"{front}/health")[0] == 200
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
