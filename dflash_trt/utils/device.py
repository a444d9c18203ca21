# SPDX-License-Identifier: Apache-2.0
"""Device and dtype names from the CLI and the LLM API, resolved to torch objects."""

from __future__ import annotations

import torch

from dflash_trt.errors import EnvironmentMissing, UsageError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise EnvironmentMissing("--device cuda requested but CUDA is not available", hint="use --device cpu")
    if device != "cpu" and not device.startswith("cuda"):
        raise UsageError(f"--device={device!r} is not supported", hint="use cpu or cuda")
    return torch.device(device)


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise UsageError(f"--dtype={dtype!r} is not supported", hint=f"use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]
