# SPDX-License-Identifier: Apache-2.0
"""KServe v2 gRPC tensor contents, and the Triton model's error messages: the one codec for our
clients and test servers.

Raw contents are little-endian; a BYTES element is a 4-byte length followed by the bytes. Typed
contents live in the `*_contents` field named by the datatype. Clients mostly read the first element
(`decode_first_*`): an llmapi output holds one value per sequence, and n = 1 is the common case;
`decode_raw` reads them all.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from typing import Any

RAW_FORMATS = {
    "BOOL": "<?",
    "INT32": "<i",
    "UINT32": "<I",
    "INT64": "<q",
    "UINT64": "<Q",
    "FP32": "<f",
    "FP64": "<d",
}

CONTENT_FIELDS = {
    "BOOL": "bool_contents",
    "INT32": "int_contents",
    "UINT32": "uint_contents",
    "INT64": "int64_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def encode_raw(datatype: str, value: Any) -> bytes:
    """One element as raw contents (str is UTF-8 encoded for BYTES)."""
    if datatype == "BYTES":
        data = value.encode() if isinstance(value, str) else bytes(value)
        return struct.pack("<I", len(data)) + data
    if datatype in ("FP32", "FP64"):
        return struct.pack(RAW_FORMATS[datatype], float(value))
    if datatype == "BOOL":
        return struct.pack("<?", bool(value))
    return struct.pack(RAW_FORMATS[datatype], int(value))


def decode_first_raw(datatype: str, raw: bytes) -> Any:
    """The first element of raw contents (bytes for BYTES); None when empty or of an unknown type."""
    if not raw:
        return None
    if datatype == "BYTES":
        (n,) = struct.unpack_from("<I", raw)
        return raw[4 : 4 + n]
    fmt = RAW_FORMATS.get(datatype)
    return struct.unpack_from(fmt, raw)[0] if fmt else None


def decode_raw(datatype: str, raw: bytes) -> list[Any]:
    """Every element of raw contents (bytes for BYTES); [] when empty or of an unknown type."""
    if datatype == "BYTES":
        out, at = [], 0
        while at + 4 <= len(raw):
            (n,) = struct.unpack_from("<I", raw, at)
            out.append(raw[at + 4 : at + 4 + n])
            at += 4 + n
        return out
    fmt = RAW_FORMATS.get(datatype)
    if not fmt or not raw:
        return []
    return [v for (v,) in struct.iter_unpack(fmt, raw)]


def decode_first_typed(datatype: str, contents: Any) -> Any:
    """The first element of typed contents (an InferTensorContents message), or None."""
    field_name = CONTENT_FIELDS.get(datatype)
    values = getattr(contents, field_name) if field_name else []
    return values[0] if values else None


# The trailer our Triton model ends every error message with (llmapi/wire.py, ERROR_TRAILER):
# "... (error: INVALID_ARG, field: max_tokens)". The kind is the TritonError code the model sent;
# gRPC stream errors carry no code, and Triton's HTTP front answers every model error with 400.
_ERROR_TRAILER = re.compile(r" \(error: ([A-Z_]+)(?:, field: ([^()]+))?\)$")


@dataclass(frozen=True, slots=True)
class ModelError:
    """An error response of the Triton model: its message, its kind and the request field at fault."""

    message: str  # without the trailer
    kind: str | None  # INVALID_ARG | UNAVAILABLE | CANCELLED | INTERNAL; None: not from our model
    field: str | None  # the request field at fault (an input name or the engine's field), when known


def parse_model_error(text: str) -> ModelError:
    """Split an error message into what the model said and its trailer (absent from Triton's own
    errors and from other models': kind and field None)."""
    m = _ERROR_TRAILER.search(text)
    if m is None:
        return ModelError(message=text, kind=None, field=None)
    return ModelError(message=text[: m.start()], kind=m.group(1), field=m.group(2))
