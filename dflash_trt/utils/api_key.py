# SPDX-License-Identifier: Apache-2.0
"""The API key of a server: where it comes from, how it travels, how it is checked.

One key guards every protected endpoint, and clients send it the same way everywhere they can:
- HTTP (the OpenAI front, Triton's KServe HTTP): `Authorization: Bearer <key>`;
- Triton gRPC: the metadata `triton-grpc-protocol-authorization: Bearer <key>` (Triton prefixes the
  header names of `--grpc-restricted-protocol` with `triton-grpc-protocol-`; checked on 2.51).

Invariants: the key is never logged or printed (`ApiKey`'s repr hides it, errors name only where it
came from); a presented key is compared in constant time (`hmac.compare_digest`); a key is printable
ASCII without spaces (it travels in a header value and in tritonserver's arguments) and at least
MIN_LENGTH characters long.
"""

from __future__ import annotations

import hmac
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from dflash_trt.errors import UsageError

ENV_VAR = "DFLASH_TRT_API_KEY"
HTTP_HEADER = "Authorization"
GRPC_HEADER = "triton-grpc-protocol-authorization"
SCHEME = "Bearer"
MIN_LENGTH = 16
MAX_LENGTH = 4096
GENERATE_HINT = "generate one with: python3 -c 'import secrets; print(secrets.token_urlsafe(32))'"


@dataclass(frozen=True, slots=True)
class ApiKey:
    """A validated key. `source` says where it came from (for messages; never the key itself)."""

    secret: str = field(repr=False)
    source: str

    def __repr__(self) -> str:
        return f"ApiKey(<{len(self.secret)} characters>, source={self.source!r})"

    @property
    def bearer(self) -> str:
        """The header value clients send: `Bearer <key>`."""
        return f"{SCHEME} {self.secret}"

    def http_headers(self) -> dict[str, str]:
        return {HTTP_HEADER: self.bearer}

    def grpc_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((GRPC_HEADER, self.bearer),)

    def accepts(self, authorization: str | None) -> bool:
        """Whether an `Authorization` header value carries this key (scheme case-insensitive, as
        RFC 7235 has it). Constant time in the presented token's content."""
        if not authorization:
            return False
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != SCHEME.lower():
            return False
        return hmac.compare_digest(token.strip().encode("utf-8", "replace"), self.secret.encode())


def check_key(secret: str, *, source: str) -> ApiKey:
    """An ApiKey, or a UsageError naming the source and the problem (never the key)."""
    if len(secret) < MIN_LENGTH:
        raise UsageError(
            f"{source}: the API key has {len(secret)} characters, fewer than {MIN_LENGTH}", hint=GENERATE_HINT
        )
    if len(secret) > MAX_LENGTH:
        raise UsageError(f"{source}: the API key has {len(secret)} characters, more than {MAX_LENGTH}",
                         hint=GENERATE_HINT)  # fmt: skip
    bad = sorted({f"{ord(c):#04x}" for c in secret if not ("!" <= c <= "~")})
    if bad:
        raise UsageError(
            f"{source}: the API key contains characters other than printable ASCII without spaces "
            f"({', '.join(bad[:5])})",
            hint="it travels in an HTTP header and in tritonserver's arguments; " + GENERATE_HINT,
        )
    return ApiKey(secret, source)


def read_key_file(path: Path) -> ApiKey:
    """The key in `path` (one line; surrounding whitespace and the final newline are dropped)."""
    source = f"--api-key-file={path}"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"{source}: no such file", hint="pass the file that holds the key") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{source}: cannot read it ({type(exc).__name__})",
                         hint="make it a readable UTF-8 text file with the key on one line") from None  # fmt: skip
    secret = text.strip()
    if "\n" in secret:
        raise UsageError(f"{source}: holds more than one line", hint="put only the key in the file")
    return check_key(secret, source=source)


def world_readable(path: Path) -> bool:
    """Whether others than the owner and group may read the key file (worth a warning)."""
    try:
        return bool(path.stat().st_mode & stat.S_IROTH)
    except OSError:
        return False


def resolve_api_key(
    *, flag: str | None, file: Path | None, env: Mapping[str, str] | None = None
) -> ApiKey | None:
    """The key from --api-key, --api-key-file or $DFLASH_TRT_API_KEY (in that order; passing both
    flags is an error), or None when none is set."""
    if flag is not None and file is not None:
        raise UsageError(
            "--api-key and --api-key-file are both set", hint="pass one of them (prefer the file)"
        )
    if flag is not None:
        return check_key(flag, source="--api-key")
    if file is not None:
        return read_key_file(file)
    value = (os.environ if env is None else env).get(ENV_VAR)
    if value:
        return check_key(value, source=f"${ENV_VAR}")
    return None
