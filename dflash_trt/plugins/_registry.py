# SPDX-License-Identifier: Apache-2.0
"""Shared plumbing of the drafting plugin: the guarded Triton import, the CPU/interpreter switch,
and small launcher helpers.

Every op module registers `dflash::<op>` with `torch.library.custom_op`: the decorated function
(the PyTorch reference) is the default implementation, `register_kernel("cuda")` adds the Triton
launcher, `register_fake` the shape function. That is the pattern under which `opcheck` and
`torch.compile(fullgraph=True)` work on a CPU-only machine (`triton_op` + `wrap_triton` do not).

Triton is imported here, guarded: without it the references still register and run, and the
CUDA kernels raise a clear error when launched. Whether `@triton.jit` kernels are interpreted is
decided when they are decorated, so `TRITON_INTERPRET=1` must be set before any op module is first
imported (in practice: before `triton` is imported at all).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

try:  # the kernels are optional: the references run without Triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is part of the dev environment
    triton = None
    tl = None

HAVE_TRITON = triton is not None


def jit(fn: Callable[..., Any]) -> Any:
    """`triton.jit` when Triton is installed; otherwise the plain function (never launched).
    Typed Any: a JIT function is launched as `kernel[grid](...)`."""
    if triton is None:  # pragma: no cover
        return fn
    return triton.jit(fn)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


_TRITON_ON_CPU = False


def set_triton_on_cpu(enabled: bool) -> None:
    """Route the ops' CPU calls to the Triton launchers (tests under TRITON_INTERPRET=1 only).

    Without it CPU calls run the PyTorch references. Compiled Triton cannot run on CPU tensors,
    so turning this on outside the interpreter is refused.
    """
    global _TRITON_ON_CPU
    if enabled and not (HAVE_TRITON and interpreting()):
        raise RuntimeError(
            "Triton kernels run on CPU tensors only under the Triton interpreter: set TRITON_INTERPRET=1 "
            "before importing triton (and dflash_trt.plugins.* op modules)"
        )
    _TRITON_ON_CPU = enabled


def triton_on_cpu() -> bool:
    return _TRITON_ON_CPU


def require_triton(op: str) -> None:
    if triton is None:
        raise RuntimeError(
            f"dflash::{op}: the CUDA kernel needs OpenAI Triton (pip install 'dflash-trt[triton]')"
        )


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def block(n: int, *, minimum: int = 16) -> int:
    """A power-of-two tile edge >= n and >= minimum (tl.dot needs every edge >= 16 on GPUs)."""
    return max(minimum, next_pow2(n))


def check(cond: bool, op: str, what: str) -> None:
    """Launcher precondition (shapes, strides, dtypes): a clear error instead of a wild access."""
    if not cond:
        raise ValueError(f"dflash::{op}: {what}")


def check_same_device(op: str, *tensors: torch.Tensor | None) -> None:
    devices = {t.device for t in tensors if t is not None}
    check(len(devices) == 1, op, f"all tensors must be on one device, got {sorted(map(str, devices))}")


def float_dtype_ok(t: torch.Tensor) -> bool:
    return t.dtype in (torch.float32, torch.float16, torch.bfloat16)


_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached; a host query, not a stream sync).
    The interpreter has no SMs: pretend 4 so the split heuristics are exercised on tiny shapes."""
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]
