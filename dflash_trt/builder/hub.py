# SPDX-License-Identifier: Apache-2.0
"""Small JSON files from the Hugging Face Hub, or from a mirror at HF_ENDPOINT, that fail fast and by name.

Planning reads two small files per repository (config.json and the weight index), so this module
talks plain HTTP(S) with one short timeout and no retries instead of going through huggingface_hub,
whose retries made an unreachable Hub look like a 23 s hang followed by a wrong error. A failure is
one of two kinds:

- `HubUnreachable` (exit 1): no answer at all (DNS, refused, no route, timeout, TLS) or a Hub that
  answered 429/5xx. The builder may fall back to the configs shipped in the package.
- `HubDenied` (exit 2): the Hub answered and said no: 401 (no or bad token, or a private repo),
  403 (a gated repo this token may not read), 404 (no such repo, revision or file on this endpoint).

Proxies from the usual environment variables (HTTPS_PROXY, NO_PROXY) are honoured by urllib.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import ssl
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

from dflash_trt import __version__
from dflash_trt.errors import DFlashTrtError, UsageError

DEFAULT_ENDPOINT = "https://huggingface.co"
TIMEOUT_S = 2.0  # DNS lookup, connect and each read; config files are a few KB
MAX_BYTES = 8 << 20
CONFIG_DIR_ENV = "DFLASH_TRT_CONFIG_DIR"  # <dir>/<org>--<name>/config.json pre-seeds configs


def env_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def describe_endpoint() -> str:
    ep = endpoint()
    if ep == DEFAULT_ENDPOINT:
        return f"the Hugging Face Hub at {ep}"
    return f"the Hub mirror HF_ENDPOINT={ep}"


def token() -> str | None:
    """HF_TOKEN (or the older HUGGING_FACE_HUB_TOKEN), else the token file `huggingface-cli login` writes."""
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        value = os.environ.get(name, "").strip()
        if value:
            return value
    path = os.environ.get("HF_TOKEN_PATH") or os.path.join(
        os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface"), "token"
    )
    try:
        value = Path(path).read_text().strip()
    except OSError:
        return None
    return value or None


def fix_options(repo_id: str | None = None) -> str:
    """Every way around a Hub problem, for the `fix:` of an error."""
    seed = f"{CONFIG_DIR_ENV}/{repo_id.replace('/', '--')}/config.json" if repo_id else f"${CONFIG_DIR_ENV}"
    return (
        "set HF_ENDPOINT to a reachable Hub mirror, set HF_TOKEN for gated repos, pass --offline (or "
        "HF_HUB_OFFLINE=1) to plan from the configs shipped with dflash-trt, put the files in "
        f"{seed}, or pass a local checkpoint directory as --target/--drafter"
    )


class HubUnreachable(DFlashTrtError):
    """No usable answer from the Hub (network failure, 429 or 5xx). Exit code 1."""

    def __init__(self, cause: str, *, repo_id: str | None = None) -> None:
        self.cause = cause
        super().__init__(f"cannot reach {describe_endpoint()} ({cause})", hint=fix_options(repo_id))


class HubDenied(UsageError):
    """The Hub answered 401, 403 or 404. Exit code 2."""

    def __init__(self, message: str, *, status: int, hint: str) -> None:
        self.status = status
        super().__init__(message, hint=hint)


def _lookup(host: str, port: int) -> None:
    """getaddrinfo ignores socket timeouts: run it in a thread and give up after TIMEOUT_S."""
    outcome: dict[str, BaseException] = {}

    def work() -> None:
        try:
            socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            outcome["error"] = exc

    worker = threading.Thread(target=work, name="dflash-trt-dns", daemon=True)
    worker.start()
    worker.join(TIMEOUT_S)
    if worker.is_alive():
        raise HubUnreachable(f"DNS lookup for {host} gave no answer within {TIMEOUT_S:g} s")
    if "error" in outcome:
        exc = outcome["error"]
        detail = getattr(exc, "strerror", None) or str(exc)
        raise HubUnreachable(f"DNS lookup failed for {host}: {detail}")


def _uses_proxy(url: str) -> bool:
    parts = urlsplit(url)
    proxies = urllib.request.getproxies()
    return parts.scheme in proxies and not urllib.request.proxy_bypass(parts.hostname or "")


def _failure(url: str, reason: object) -> str:
    """The cause of a failed request, naming the proxy when one carried it."""
    parts = urlsplit(url)
    if _uses_proxy(url):
        proxy = urllib.request.getproxies()[parts.scheme]
        pp = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        cause = _network_cause(reason, pp.hostname or "", pp.port or (443 if pp.scheme == "https" else 80))
        return f"through the proxy {proxy}: {cause}"
    return _network_cause(
        reason, parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    )


def _network_cause(reason: object, host: str, port: int) -> str:
    if isinstance(reason, socket.gaierror):
        return f"DNS lookup failed for {host}: {reason.strerror or reason}"
    if isinstance(reason, ConnectionRefusedError):
        return f"connection refused by {host}:{port}"
    if isinstance(reason, (TimeoutError, socket.timeout)):
        return f"no answer from {host}:{port} within {TIMEOUT_S:g} s"
    if isinstance(reason, ssl.SSLError):
        return f"TLS handshake with {host} failed: {getattr(reason, 'reason', None) or reason}"
    if isinstance(reason, OSError) and reason.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH):
        return f"no route to {host}:{port}"
    if isinstance(reason, OSError) and reason.errno in (errno.ECONNRESET, errno.EPIPE):
        return f"connection to {host}:{port} was reset"
    text = getattr(reason, "strerror", None) or str(reason)
    return f"{type(reason).__name__} talking to {host}:{port}: {text}"


def _denied(status: int, code: str, repo_id: str, filename: str, revision: str) -> HubDenied:
    where = describe_endpoint()
    sent = token() is not None
    mirror = endpoint() != DEFAULT_ENDPOINT
    label = f"HTTP {status}" + (f" {code}" if code else "")
    what = f"{where} refused {repo_id}/{filename} ({label})"
    if code == "GatedRepo" or (status == 403 and code != "RepoNotFound"):
        if sent:
            return HubDenied(
                f"{what}: {repo_id} is gated and this HF_TOKEN has no access to it",
                status=status,
                hint=f"accept the license of {repo_id} on the Hub with the token's account, or use a token "
                "that has access; or pass --offline to plan from the shipped configs",
            )
        return HubDenied(
            f"{what}: {repo_id} is gated and no token was sent",
            status=status,
            hint=f"set HF_TOKEN to a token that accepted the license of {repo_id}; or pass --offline to "
            "plan from the shipped configs",
        )
    if status == 401 and code not in ("RepoNotFound", "EntryNotFound", "RevisionNotFound"):
        if sent:
            return HubDenied(
                f"{what}: HF_TOKEN was rejected (expired, revoked or for another endpoint)",
                status=status,
                hint="create a new read token and set HF_TOKEN to it",
            )
        return HubDenied(
            f"{what}: authentication required (a private or gated repo, or a mirror that needs a token)",
            status=status,
            hint=f"set HF_TOKEN to a token with access to {repo_id}",
        )
    # 404, or 401 with RepoNotFound (the Hub hides private repos behind 401)
    if code == "RevisionNotFound":
        return HubDenied(
            f"{what}: revision {revision!r} does not exist", status=status, hint="check the revision"
        )
    if code == "EntryNotFound":
        return HubDenied(
            f"{what}: the repository has no {filename}",
            status=status,
            hint="check that the id names a transformers checkpoint",
        )
    if mirror:
        return HubDenied(
            f"{what}: the mirror does not serve {repo_id}",
            status=status,
            hint=f"mirror {repo_id} at {endpoint()}, check the id (see `dflash-trt models`), or unset "
            "HF_ENDPOINT",
        )
    return HubDenied(
        f"{what}: no repository {repo_id}" + (" visible to this token" if sent else ""),
        status=status,
        hint="check the id (see `dflash-trt models`)"
        + ("" if sent else ", or set HF_TOKEN if it is private"),
    )


def get_json(
    repo_id: str, filename: str, *, revision: str = "main", optional: bool = False
) -> tuple[Any, str | None]:
    """(parsed JSON, the commit the Hub resolved `revision` to); (None, None) when `optional` and the
    Hub says the file does not exist. Raises HubUnreachable or HubDenied, each naming the cause.
    """
    url = f"{endpoint()}/{quote(repo_id)}/resolve/{quote(revision, safe='')}/{quote(filename)}"
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    if parts.scheme not in ("http", "https") or not host:
        raise UsageError(
            f"HF_ENDPOINT={endpoint()!r} is not an http(s) URL",
            hint="e.g. HF_ENDPOINT=https://hf-mirror.example",
        )
    try:
        if not _uses_proxy(url):
            _lookup(host, port)
        headers = {"User-Agent": f"dflash-trt/{__version__}", "Accept": "application/json"}
        request = urllib.request.Request(url, headers=headers)
        tok = token()
        if tok:  # never forwarded by a redirect (the Hub redirects large files to another host)
            request.add_unredirected_header("Authorization", f"Bearer {tok}")
        # a fresh opener: urlopen's global one keeps the proxies of the environment it first saw
        opener = urllib.request.build_opener(urllib.request.ProxyHandler())
        with opener.open(request, timeout=TIMEOUT_S) as resp:
            body = resp.read(MAX_BYTES + 1)
            commit = resp.headers.get("X-Repo-Commit") or None
    except HubUnreachable as exc:
        exc.hint = fix_options(repo_id)
        raise
    except urllib.error.HTTPError as exc:
        code = exc.headers.get("X-Error-Code", "") if exc.headers else ""
        exc.close()
        if exc.code in (401, 403, 404):
            if optional and (exc.code == 404 or code == "EntryNotFound"):
                return None, None
            raise _denied(exc.code, code, repo_id, filename, revision) from None
        raise HubUnreachable(f"{host} answered HTTP {exc.code} {exc.reason}", repo_id=repo_id) from None
    except urllib.error.URLError as exc:
        raise HubUnreachable(_failure(url, exc.reason), repo_id=repo_id) from None
    except (OSError, ValueError) as exc:  # timeouts and resets while reading the body
        raise HubUnreachable(_failure(url, exc), repo_id=repo_id) from None
    if len(body) > MAX_BYTES:
        raise HubUnreachable(
            f"{url} is larger than {MAX_BYTES >> 20} MiB, not a config file", repo_id=repo_id
        )
    try:
        return json.loads(body), commit
    except ValueError:
        raise HubUnreachable(
            f"{url} did not answer JSON (a captive portal or a proxy login page?)", repo_id=repo_id
        ) from None
