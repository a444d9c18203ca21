# SPDX-License-Identifier: Apache-2.0
"""dflash-trt's own CPU GEMMs for decoding: two C kernels on one packed bf16 layout, and C++ torch
operators for fp32 weights (`dflash_f32::linear`) and for the bf16 kernel (`dflash_bf16::linear`), at
the end of this module.

Why. Decoding multiplies a handful of rows by every weight of the model: on a CPU the step is the
time it takes to stream the weights from memory. Both kernels read a weight once per call whatever
the number of rows.
- `gemm_bf16.c` (CPUs with AVX512-BF16; bf16 in, bf16 out): one `vdpbf16ps` per 64-byte load.
  Against oneDNN's prepacked bf16 GEMM on a 2-core AMD EPYC (2 threads, 2026-11-27, bench/cpu_gemm.py):
  the qwen3-0.3b LM head ([151936, 1024], 311 MB) at 1 row in 6.4 ms (48 GB/s) against 9.8 ms, the
  layers' projections 1.30-1.39x faster at 1 row, 1.06-1.12x at 16, 0.99-1.08x at 64.
- `gemm_bf16w_f32.c` (AVX2 and FMA, no native bf16; fp32 in, fp32 out): the weights stay bf16 in
  memory, half the bytes of the fp32 copy a model would otherwise hold there, and are widened to fp32
  in registers. Used for fp32 models whose weights are exactly bf16 values (a bf16 checkpoint loaded
  in fp32: the widening is exact, only the summation order differs from an fp32 GEMM).

Numerics: fp32 accumulation; the bf16 kernel rounds once to bf16 at the end (nearest even), as
oneDNN's. Summation orders differ from oneDNN's and MKL's: a result may differ in its last bit.

Layout. A weight [N, K] is packed once, at load, as bf16 [ceil(N/16), K/2, 16, 2]: blocks of 16 output
columns with K in pairs (one 64-byte load = one K-pair for 16 outputs). K must be even; N is padded.

Build. Each C source beside this module is compiled at first use with the C compiler ($CC, else gcc
or cc: the one inductor needs anyway) into the kernel cache (layers/native.py). Without the CPU
features, a compiler or a writable cache a kernel is unavailable and callers keep oneDNN / MKL.
DFLASH_TRT_CPU_GEMM=0 turns both off.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import platform
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

from dflash_trt.layers import native
from dflash_trt.utils.device import cpu_flags
from dflash_trt.utils.env import scoped_env

log = logging.getLogger(__name__)

SWITCH_ENV = "DFLASH_TRT_CPU_GEMM"  # "0": oneDNN's / MKL's GEMMs everywhere
BLOCK = 16  # output columns per packed block


class _Kernel(NamedTuple):
    source: str  # beside this module
    symbol: str
    cpu_flags: frozenset[str]  # /proc/cpuinfo flags the code needs
    cc_flags: tuple[str, ...]
    dtype: torch.dtype  # of x, y (and what the bias is read as: fp32 always)


_COMMON = ("-O3", "-fopenmp", "-shared", "-fPIC")
BF16 = _Kernel("gemm_bf16.c", "dflash_gemm_bf16", frozenset({"avx512_bf16"}),
               ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", *_COMMON), torch.bfloat16)  # fmt: skip
F32 = _Kernel("gemm_bf16w_f32.c", "dflash_gemm_bf16w_f32", frozenset({"avx2", "fma"}),
              ("-mavx2", "-mfma", *_COMMON), torch.float32)  # fmt: skip
KERNELS = {torch.bfloat16: BF16, torch.float32: F32}  # by the activations' dtype


class BlockedWeight(NamedTuple):
    """A weight [n, k] packed for `gemm`: data is [ceil(n/16), k/2, 16, 2] bf16."""

    data: torch.Tensor
    n: int
    k: int


@contextlib.contextmanager
def switched(on: bool) -> Iterator[None]:
    """Inside: both kernels on (where they run) or off, as DFLASH_TRT_CPU_GEMM says for this process
    and its children; weights are bound to a kernel when packed, so it is the loads inside that count."""
    with scoped_env(SWITCH_ENV, "1" if on else "0"):
        _entry.cache_clear()
        try:
            yield
        finally:
            _entry.cache_clear()  # the switch as restored is read on the next call


def available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the kernel for `dtype` activations runs here (CPU features, build and load)."""
    kernel = KERNELS.get(dtype)
    return kernel is not None and _entry(kernel) is not None


def supports(weight: torch.Tensor) -> bool:
    """Whether `pack` takes this weight for a model in its dtype: bf16 (AVX512-BF16 kernel), or fp32
    whose every value is a bf16 value (AVX2 kernel; checked, a full pass over the weight); on the CPU,
    2-D with an even K."""
    if not (weight.device.type == "cpu" and weight.dim() == 2 and weight.shape[1] % 2 == 0):
        return False
    if weight.shape[1] == 0 or not available(weight.dtype):
        return False
    return weight.dtype == torch.bfloat16 or bool(torch.equal(weight.to(torch.bfloat16).float(), weight))


def pack(weight: torch.Tensor) -> BlockedWeight:
    """`weight` [N, K] (K even) in the kernels' layout, as bf16 (a new tensor; `weight` is unchanged)."""
    n, k = weight.shape
    dense = _whole_blocks(weight.detach().to(torch.bfloat16))
    data = dense.reshape(-1, BLOCK, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return BlockedWeight(data, n, k)


def _whole_blocks(dense: torch.Tensor) -> torch.Tensor:
    """`dense` [N, K] with zero rows appended up to a whole number of BLOCK-row blocks."""
    extra = -dense.shape[0] % BLOCK
    return torch.cat([dense, dense.new_zeros(extra, dense.shape[1])]) if extra else dense


def gemm(x: torch.Tensor, weight: BlockedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ weight^T (+ bias) -> [..., N] in x's dtype (bf16 or fp32), on `threads()`."""
    kernel = KERNELS.get(x.dtype)
    entry = None if kernel is None else _entry(kernel)
    if kernel is None or entry is None:
        raise RuntimeError(f"dflash_trt's CPU GEMM for {x.dtype} inputs is not available here ({SWITCH_ENV}, "
                           "CPU features or build)")  # fmt: skip
    if x.shape[-1] != weight.k:
        raise ValueError(f"gemm: input has {x.shape[-1]} features, the weight {weight.k}")
    flat = x.reshape(-1, weight.k).contiguous()
    out = torch.empty(flat.shape[0], weight.n, dtype=x.dtype)
    b = None if bias is None else bias.to(torch.float32).contiguous()
    if flat.shape[0]:
        entry(flat.data_ptr(), flat.shape[0], weight.k, weight.data.data_ptr(), weight.n,
              None if b is None else b.data_ptr(), out.data_ptr(), threads())  # fmt: skip
    return out.view(*x.shape[:-1], weight.n)


@functools.cache
def _entry(kernel: _Kernel) -> Any:
    """The kernel's C function, or None where it cannot run (logged once)."""
    if os.environ.get(SWITCH_ENV, "1") == "0":
        return None
    if platform.machine().lower() not in ("x86_64", "amd64") or not kernel.cpu_flags <= cpu_flags():
        return None
    try:
        path = _build(kernel)
        lib = ctypes.CDLL(str(path))  # after torch: its OpenMP runtime is the one already loaded
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        log.warning("dflash_trt's CPU GEMM %s is unavailable (%s); using torch's", kernel.source, exc)
        return None
    fn = getattr(lib, kernel.symbol)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_long,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]  # fmt: skip
    fn.restype = None
    return fn


def _build(kernel: _Kernel) -> Path:
    """The shared library for this source, flags and compiler: from the cache, or compiled now."""
    cc = native.compiler("CC", ("gcc", "cc"), "no C compiler on PATH (set CC or install gcc)")
    return native.compiled_library(cc, Path(__file__).with_name(kernel.source), kernel.cc_flags)


# --- fp32: a torch operator of our own (gemm_f32_op.cpp) -----------------------------------------------
# fp32 models (`tiny`, small drafters) run their linears through `dflash_f32::linear` on CPUs with
# AVX-512F: a C++ operator registered with the dispatcher (a compiled round calls it as it calls
# aten::mm), on weights packed once as [ceil(N/16), K, 16]. Same switch (DFLASH_TRT_CPU_GEMM=0) and
# cache as the C kernels above; built with g++ against the installed torch (~10 s, once per torch
# version and compiler).
F32_OP_SOURCE = "gemm_f32_op.cpp"
F32_OP_FLAGS = ("-mavx512f",)


def f32_available() -> bool:
    """Whether `dflash_f32::linear` runs here: the switch, an x86-64 CPU with AVX-512F, and the
    operator built and loaded (built at the first call that needs it)."""
    return _runs_here(frozenset({"avx512f"})) and _load_linear_op("dflash_f32", F32_OP_SOURCE, F32_OP_FLAGS)


def pack_f32(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] fp32 in `dflash_f32::linear`'s layout [ceil(N/16), K, 16] (N padded with zeros)."""
    dense = _whole_blocks(weight.detach().to(torch.float32))
    return dense.reshape(-1, BLOCK, weight.shape[1]).permute(0, 2, 1).contiguous()


# --- bf16: the same kernel as a torch operator (gemm_bf16_op.cpp) ------------------------------------
# bf16 weights whose width is a whole number of blocks run through `dflash_bf16::linear`: gemm_bf16.c
# compiled into a C++ operator, so that a compiled round calls it without Python in between (through
# the Python op, each of smollm2-135m's 121 linears a step cost tens of microseconds before the kernel
# ran). The layer holds the packed tensor itself (4-D). Same switch and cache as the C kernels.
BF16_OP_SOURCE = "gemm_bf16_op.cpp"
TEAM_SOURCE = "spin_team.h"  # the operator's own worker threads
BF16_OP_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp")


def bf16_op_available() -> bool:
    """Whether `dflash_bf16::linear` runs here: the switch, a CPU with AVX512-BF16, and the operator
    built and loaded (built at the first call that needs it)."""
    return _runs_here(BF16.cpu_flags) and _load_linear_op(
        "dflash_bf16", BF16_OP_SOURCE, BF16_OP_FLAGS, BF16.source, TEAM_SOURCE
    )


# --- threads ------------------------------------------------------------------------------------------
# The bf16 kernel takes a thread count apart from torch's: an engine whose linears all run through
# `dflash_bf16::linear` keeps torch (inductor's kernels) on one thread and lets the operator split every
# product over that many threads of its own (spin_team.h), a team the paged-attention operator
# (cpu_attention) splits its heads over too; the ctypes path `gemm` splits products of 8 rows or more on
# OpenMP's. Set once, process-wide; the team holds its own copy, so that a compiled round never sees it
# (`engine_threads`).
_threads = 0  # 0: torch's thread count
_bf16_op_loaded = False  # dflash_bf16::linear (and its set_threads) is loaded in this process


def threads() -> int:
    """The most threads the bf16 kernels use for a product of many rows."""
    return _threads or torch.get_num_threads()


def set_threads(n: int) -> None:
    """Let the bf16 kernels (and the paged attention, where the bf16 operator is loaded) use up to `n`
    threads (0: torch's count, read at each call)."""
    global _threads
    if n < 0:
        raise ValueError(f"set_threads: n={n}; pass 0 (torch's count) or more")
    _threads = n
    if _bf16_op_loaded:
        torch.ops.dflash_bf16.set_threads(n)


def own_threads() -> int:
    """The kernels' own count as set (0: none of their own, torch's)."""
    return _threads


@contextlib.contextmanager
def all_cores() -> Iterator[None]:
    """torch on the kernels' own count inside the block, where `engine_threads` put it on one: a prefill's
    thousands of rows are wide work for every operator (attention, norms), not only for the GEMMs.
    Compiled code is guarded on torch's count, so whatever is compiled inside runs inside too."""
    before = torch.get_num_threads()
    if not _threads or _threads == before:
        yield
        return
    torch.set_num_threads(_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def engine_threads(dtype: torch.dtype, budget: int) -> int:
    """torch's thread count for an engine that may use `budget` cores, with the kernels' count set:
    1 when its bf16 linears run through `dflash_bf16::linear` (the kernel then takes the budget),
    else `budget` (oneDNN's and MKL's GEMMs run on torch's threads). A prefill gives torch the cores
    back (`all_cores`). On smollm2-135m (2-core AMD EPYC) the split ran plain decoding 1.15-1.24x,
    1.47-1.54x and 1.07-1.44x faster at batch 1, 4 and 16 than two threads for everything
    (bench/README.md, "One thread for the step's small operators"), and the operator's own team
    1.16-1.34x faster again at batch 1 ("The GEMM's own threads")."""
    if budget > 1 and dtype == torch.bfloat16 and bf16_op_available():
        set_threads(budget)
        return 1
    set_threads(0)
    return budget


def _runs_here(needs: frozenset[str]) -> bool:
    """The switch is on, and this is an x86-64 CPU with the flags `needs`."""
    if os.environ.get(SWITCH_ENV, "1") == "0":
        return False
    return platform.machine().lower() in ("x86_64", "amd64") and needs <= cpu_flags()


@functools.cache
def _load_linear_op(namespace: str, source: str, flags: tuple[str, ...], *includes: str) -> bool:
    """Build (or take from the cache) and load the operator `namespace::linear(x, w, bias, n)` from
    `source` beside this module, and give torch.compile its shape; False, logged, where it cannot be
    built (callers keep the other path). `includes`: the files beside it that the source includes."""
    global _bf16_op_loaded
    here = Path(__file__).parent
    try:
        path = native.torch_op_library(here / source, flags, includes=[here / name for name in includes])
        torch.ops.load_library(str(path))
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        log.warning("dflash_trt's CPU GEMM operator %s::linear is unavailable (%s)", namespace, exc)
        return False
    torch.library.register_fake(f"{namespace}::linear")(_linear_shape)
    if namespace == "dflash_bf16":
        _bf16_op_loaded = True
        torch.ops.dflash_bf16.set_threads(_threads)
    return True


def _linear_shape(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], n)
