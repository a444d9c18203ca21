# SPDX-License-Identifier: Apache-2.0
"""dflash-trt's CPU attention over a paged KV pool, read in place: the torch operator
`dflash_cpu::paged_attention` (paged_attention_op.cpp beside this module).

Why. A decode round has a few query rows per sequence (1 for plain decoding, g + 1 for a DFlash block,
the tree's nodes for DDTree). The general path (`attention.attend_paged` without the kernel) first
copies each sequence's context K and V out of the pool, per layer, then runs SDPA on the copy. The
operator reads each key from its slot once, for every query head that shares it, and writes the output
token-major, as o_proj reads it. Prompt chunks (many rows) keep the general path: torch's SDPA is the
better kernel there.

`enable(model, ...)` switches a loaded model's attention modules (those with a `paged_kernel`
attribute and no attention sinks) to the operator, after building and loading it (g++, torch's
headers, ~15 s once per machine and torch version: layers/native.py). Without an x86-64 CPU with AVX2
and FMA, a C++ compiler or a writable kernel cache, or with DFLASH_TRT_CPU_ATTENTION=0, nothing changes.
"""

from __future__ import annotations

import platform
from pathlib import Path

import torch
from torch import nn

from dflash_trt.layers import native
from dflash_trt.utils.device import cpu_flags

SWITCH_ENV = "DFLASH_TRT_CPU_ATTENTION"  # "0": gather the context and use SDPA everywhere
DTYPES = (torch.float32, torch.bfloat16)


def available() -> bool:
    """Whether the operator runs here: an x86-64 CPU with AVX2 and FMA, the switch, and the operator
    built and loaded (built at the first call)."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not cpu_flags() >= {"avx2", "fma"}:
        return False
    return _OP.available()


def enable(model: nn.Module, *, device: torch.device, dtype: torch.dtype) -> int:
    """Route the attention of `model` (on `device`, in `dtype`) through the operator where it applies:
    CPU, float32 or bfloat16, modules with a `paged_kernel` attribute and no attention sinks. Returns
    how many modules were switched (0 where the operator is unavailable)."""
    if device.type != "cpu" or dtype not in DTYPES:
        return 0
    modules = [m for m in model.modules() if hasattr(m, "paged_kernel") and getattr(m, "sinks", None) is None]
    if not modules or not available():
        return 0
    for m in modules:
        setattr(m, "paged_kernel", True)  # noqa: B010 (an attribute of the models' attention classes)
    return len(modules)


def _fakes() -> None:
    @torch.library.register_fake("dflash_cpu::paged_attention")
    def _(
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        ctx_index: torch.Tensor,
        k_new: torch.Tensor | None,
        v_new: torch.Tensor | None,
        mask: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        return q.new_empty(q.shape)


_OP = native.TorchOp(Path(__file__).with_name("paged_attention_op.cpp"), SWITCH_ENV, "CPU paged attention",
                     "torch's SDPA", fakes=_fakes,
                     isa_flags=lambda: ("-mavx512f",) if "avx512f" in cpu_flags() else ("-mavx2", "-mfma"),
                     includes=("spin_team.h",))  # fmt: skip
