# SPDX-License-Identifier: Apache-2.0
"""bf16 GEMMs on CPUs with AVX512-BF16: dflash-trt's own kernel (`gemm_bf16.c`), for decoding.

Why. Decoding multiplies a handful of rows by every weight of the model: on a CPU the step is the
time it takes to stream the weights from memory. oneDNN's prepacked bf16 GEMM reads them at ~0.9x
of what a plain `x.sum()` reads on a 2-core AMD EPYC. This kernel reads a weight once per call
whatever the number of rows, with one `vdpbf16ps` per 64-byte load. Measured on that machine
(2 threads, 2026-11-27; `x.sum()` read 30.4 GB/s): the qwen3-0.3b LM head ([151936, 1024], 311 MB)
at 1 row in 9.0 ms (34.7 GB/s) against oneDNN's 11.1 ms; the layers' projections 1.45-1.77x faster
at 1-2 rows, 1.07-1.13x at 16, 1.02-1.05x at 64; same maximum error against an fp32 product.

Numerics: fp32 accumulation of bf16 products, one rounding to bf16 at the end (nearest even), as
oneDNN's; the summation order differs, so a result may differ from oneDNN's in its last bf16 bit.

Layout. A weight [N, K] is packed once, at load, as [ceil(N/16), K/2, 16, 2]: blocks of 16 output
columns with K in pairs (one load = one K-pair for 16 outputs). K must be even; N is padded to 16.

Build. The C source beside this module is compiled at first use with the C compiler ($CC, else gcc
or cc: the one inductor needs anyway) into $DFLASH_TRT_KERNEL_CACHE or ~/.cache/dflash-trt/kernels,
under a digest of the source, the flags and the compiler's version; written to a temporary name and
renamed, so concurrent processes never load half a file. Without the CPU feature, a compiler or a
writable cache, `available()` is False and callers keep oneDNN. DFLASH_TRT_CPU_GEMM=0 turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch

log = logging.getLogger(__name__)

SWITCH_ENV = "DFLASH_TRT_CPU_GEMM"  # "0": oneDNN's prepacked GEMM everywhere
CACHE_ENV = "DFLASH_TRT_KERNEL_CACHE"
DEFAULT_CACHE = Path("~/.cache/dflash-trt/kernels")
SOURCE = Path(__file__).with_name("gemm_bf16.c")
FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp", "-shared", "-fPIC")
BLOCK = 16  # output columns per packed block (one zmm of fp32 accumulators)


class BlockedWeight(NamedTuple):
    """A weight [n, k] packed for `gemm`: data is [ceil(n/16), k/2, 16, 2] bf16."""

    data: torch.Tensor
    n: int
    k: int


def available() -> bool:
    """Whether the kernel runs here (the CPU has AVX512-BF16 and the library built and loaded)."""
    return _entry() is not None


def supports(weight: torch.Tensor) -> bool:
    """Whether `pack` takes this weight: bf16, on the CPU, 2-D with an even K, and the kernel runs."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.shape[1] % 2 == 0
        and weight.shape[1] > 0
        and available()
    )


def pack(weight: torch.Tensor) -> BlockedWeight:
    """`weight` [N, K] (bf16, K even) in the kernel's layout (a new tensor; `weight` is unchanged)."""
    n, k = weight.shape
    blocks = -(-n // BLOCK)
    dense = weight.detach()
    if blocks * BLOCK != n:
        dense = weight.new_zeros(blocks * BLOCK, k)
        dense[:n] = weight.detach()
    data = dense.reshape(blocks, BLOCK, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return BlockedWeight(data, n, k)


def gemm(x: torch.Tensor, weight: BlockedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ weight^T (+ bias) -> [..., N], bf16, on torch's current thread count."""
    entry = _entry()
    if entry is None:
        raise RuntimeError(f"dflash_trt's bf16 GEMM is not available here ({SWITCH_ENV}, CPU or build)")
    if x.shape[-1] != weight.k:
        raise ValueError(f"gemm: input has {x.shape[-1]} features, the weight {weight.k}")
    flat = x.reshape(-1, weight.k).to(torch.bfloat16).contiguous()
    out = torch.empty(flat.shape[0], weight.n, dtype=torch.bfloat16)
    b = None if bias is None else bias.to(torch.float32).contiguous()
    if flat.shape[0]:
        entry(flat.data_ptr(), flat.shape[0], weight.k, weight.data.data_ptr(), weight.n,
              None if b is None else b.data_ptr(), out.data_ptr(), torch.get_num_threads())  # fmt: skip
    return out.view(*x.shape[:-1], weight.n)


@functools.cache
def _entry() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if os.environ.get(SWITCH_ENV, "1") == "0":
        return None
    if platform.machine().lower() not in ("x86_64", "amd64") or not _cpu_has("avx512_bf16"):
        return None
    try:
        path = _build()
        lib = ctypes.CDLL(str(path))  # after torch: its OpenMP runtime is the one already loaded
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        log.warning("dflash_trt's bf16 GEMM is unavailable (%s); using oneDNN's", exc)
        return None
    fn = lib.dflash_gemm_bf16
    fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_long,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]  # fmt: skip
    fn.restype = None
    return fn


def _cpu_has(flag: str) -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(line.startswith("flags") and flag in line.split() for line in text.splitlines())


def _build() -> Path:
    """The shared library for this source, flags and compiler: from the cache, or compiled now."""
    cc = os.environ.get("CC") or next((c for c in ("gcc", "cc") if shutil.which(c)), None)
    if cc is None or shutil.which(cc) is None:
        raise RuntimeError("no C compiler on PATH (set CC or install gcc)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True, timeout=60).stdout
    digest = hashlib.sha256(SOURCE.read_bytes() + repr(FLAGS).encode() + version.encode()).hexdigest()[:16]
    root = Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()
    path = root / f"gemm_bf16-{digest}.so"
    if path.is_file():
        return path
    root.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=root, prefix=".gemm_bf16-", suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run(
            [cc, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=300
        )
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip().splitlines()[-1:] or done.returncode}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built dflash_trt's bf16 GEMM: %s", path)
    return path
