# SPDX-License-Identifier: Apache-2.0
"""Device and dtype names from the CLI and the LLM API, resolved to torch objects."""

from __future__ import annotations

import functools

import torch

from dflash_trt.errors import EnvironmentMissing, UsageError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# A decode step reads each weight once. While the weights in fp32 fit in a CPU's caches, a step's cost is
# per-call overheads, and fp32 GEMMs (MKL, ~5 us a call) beat bf16 ones (oneDNN, ~20 us): `tiny` (2.4 M
# parameters, 10 MB in fp32) runs a plain compiled step in 1.3 ms in fp32 and 4.9 ms in bf16. Weights read
# from memory make it bytes: SmolLM2-135M (134 M parameters a step, 540 MB in fp32) decodes 1.4x faster in
# bf16 at batch 1 (2 vCPU AMD EPYC Zen 4 with AVX512-BF16; bench/README.md). This is the line between.
CPU_STREAMING_MIN_BYTES = 64 << 20  # fp32 weight bytes a step reads, from which the CPU streams them


def streams_weights(num_step_parameters: int) -> bool:
    """A step of a model reading this many parameters is bound by memory bytes, not per-call costs."""
    return 4 * num_step_parameters >= CPU_STREAMING_MIN_BYTES


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise EnvironmentMissing("--device cuda requested but CUDA is not available", hint="use --device cpu")
    if device != "cpu" and not device.startswith("cuda"):
        raise UsageError(f"--device={device!r} is not supported", hint="use cpu or cuda")
    return torch.device(device)


def resolve_dtype(
    dtype: str | None,
    device: torch.device,
    *,
    checkpoint_dtype: torch.dtype | None = None,
    num_step_parameters: int | None = None,
) -> torch.dtype:
    """An explicit dtype name, or the 'auto' policy:
    - CUDA: the checkpoint's half dtype (bfloat16 when it is float32 or unknown);
    - CPU: the checkpoint's bfloat16/float16 where the CPU computes bf16 natively (AVX512-BF16 or AMX)
      and a step reads enough weights for bytes to matter more than per-call overheads
      (`streams_weights`); float32 otherwise (emulated bf16 GEMMs are slower than fp32 ones)."""
    if dtype not in (None, "auto"):
        if dtype not in DTYPES:
            raise UsageError(f"--dtype={dtype!r} is not supported", hint=f"use one of {', '.join(DTYPES)}")
        return DTYPES[dtype]
    half = checkpoint_dtype in (torch.bfloat16, torch.float16)
    if device.type == "cuda":
        return checkpoint_dtype if half and checkpoint_dtype is not None else torch.bfloat16
    streaming = num_step_parameters is not None and streams_weights(num_step_parameters)
    if half and streaming and cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_model_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else what the platform module reports: benchmarks
    print it next to every figure."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 GEMMs run natively instead of being emulated."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())
