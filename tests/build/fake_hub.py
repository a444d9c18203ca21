# SPDX-License-Identifier: Apache-2.0
"""A Hugging Face Hub stand-in on 127.0.0.1 for HF_ENDPOINT: serves `<repo>/resolve/<rev>/<file>`
from a dict, answers chosen status codes with the Hub's X-Error-Code header, records every request."""

from __future__ import annotations

import json
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class Hub:
    files: dict[str, Any] = field(default_factory=dict)  # "org/name/file" -> JSON-able
    # "org/name" -> (status, X-Error-Code) for every file of that repo
    refuse: dict[str, tuple[int, str]] = field(default_factory=dict)
    token: str | None = None  # when set, other Authorization headers get 401
    redirect: dict[str, str] = field(default_factory=dict)  # "org/name/file" -> absolute URL (302)
    requests: list[tuple[str, str | None]] = field(default_factory=list)  # (path, Authorization)
    url: str = ""

    def add_repo(self, repo: str, config: dict[str, Any], total_size: int | None = None) -> None:
        self.files[f"{repo}/config.json"] = config
        if total_size is not None:
            self.files[f"{repo}/model.safetensors.index.json"] = {
                "metadata": {"total_size": total_size},
                "weight_map": {},
            }


def serve(hub: Hub):
    """Context manager body: start a threaded server for `hub`; returns (server, thread)."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            auth = self.headers.get("Authorization")
            hub.requests.append((self.path, auth))
            parts = self.path.lstrip("/").split("/")
            if len(parts) < 5 or parts[2] != "resolve":
                return self._send(404, b"{}", {"X-Error-Code": "RepoNotFound"})
            repo, filename = "/".join(parts[:2]), "/".join(parts[4:])
            if repo in hub.refuse:
                status, code = hub.refuse[repo]
                return self._send(status, b'{"error": "no"}', {"X-Error-Code": code} if code else {})
            if hub.token is not None and auth != f"Bearer {hub.token}":
                return self._send(401, b'{"error": "auth"}', {})
            key = f"{repo}/{filename}"
            if key in hub.redirect:
                return self._send(302, b"", {"Location": hub.redirect[key]})
            if key not in hub.files:
                code = "EntryNotFound" if f"{repo}/config.json" in hub.files else "RepoNotFound"
                return self._send(404, b"{}", {"X-Error-Code": code})
            body = json.dumps(hub.files[key]).encode()
            self._send(200, body, {"Content-Type": "application/json", "X-Repo-Commit": COMMIT})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    return server, thread


def closed_port() -> int:
    """A loopback port with nothing listening (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Silent:
    """A listening socket that never accepts: connects succeed (backlog), nothing is ever answered."""

    def __enter__(self) -> str:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def __exit__(self, *exc: object) -> None:
        self.sock.close()
