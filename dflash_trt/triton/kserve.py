# SPDX-License-Identifier: Apache-2.0
"""KServe v2 gRPC tensor contents: the one codec for our clients and test servers.

Raw contents are little-endian; a BYTES element is a 4-byte length followed by the bytes. Typed
contents live in the `*_contents` field named by the datatype. Only the first element of a
tensor is read: every llmapi input and output is a [1] tensor.
"""

from __future__ import annotations

import struct
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


def decode_first_typed(datatype: str, contents: Any) -> Any:
    """The first element of typed contents (an InferTensorContents message), or None."""
    field_name = CONTENT_FIELDS.get(datatype)
    values = getattr(contents, field_name) if field_name else []
    return values[0] if values else None
