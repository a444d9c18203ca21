# SPDX-License-Identifier: Apache-2.0
"""Compiled rounds: when torch.compile can run here, its options, and where its artifacts live.

On CPU the round is compiled by inductor with its C++ wrapper: the whole round (both models, the
sampling and the acceptance) becomes one C++ function whose kernels are called without Python in
between, and which runs without the GIL (so the serving threads of the same process keep running).
Shapes are dynamic (batch, context pages), so one graph serves every batch size above one, one more
serves batch 1 (torch specialises sizes of 1), per draft length and sampling mode.

Artifacts (inductor's FX-graph and kernel caches) go to one directory per torch version and CPU/GPU
kind, under a root that `serve` points at the bundle (`<bundle>/compile-cache`, shared by every pod
that mounts the bundle) and the library defaults to `~/.cache/dflash-trt/compile`. A warm cache turns
minutes of compilation into seconds of tracing.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where it is used: `serve` reads the names below without it
    import torch

log = logging.getLogger(__name__)

COMPILE_ENV = "DFLASH_TRT_COMPILE"  # "0": eager rounds by default (tests that start many engines)
CACHE_ENV = "DFLASH_TRT_COMPILE_CACHE"  # the cache root
BUNDLE_CACHE_DIR = "compile-cache"  # `serve`'s cache root inside a writable bundle
DEFAULT_CACHE_ROOT = Path("~/.cache/dflash-trt/compile")


def unsupported_reason(device: torch.device) -> str | None:
    """Why rounds cannot be compiled on `device`, or None when they can."""
    if device.type == "cpu":
        compiler = os.environ.get("CXX") or next(
            (c for c in ("g++", "c++", "clang++") if shutil.which(c)), None
        )
        if compiler is None or shutil.which(compiler) is None:
            return (
                "no C++ compiler on PATH (inductor builds its CPU kernels with one; set CXX or install g++)"
            )
        return None
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "the triton package is not installed (inductor's CUDA kernels need it)"
        return None
    return f"torch.compile is not used on {device.type}"


def machine_key(device: torch.device) -> str:
    """torch version + what the generated code depends on: the CPU's vector ISA, or the GPU model."""
    import torch

    from dflash_trt.utils.device import cpu_flags

    if device.type == "cuda":
        kind = torch.cuda.get_device_name(device).replace(" ", "-")
    else:
        flags = cpu_flags()
        isa = [
            f
            for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "asimd", "sve")
            if f in flags
        ]
        kind = f"{platform.machine()}-" + hashlib.sha1(" ".join(isa).encode()).hexdigest()[:8]
    return f"torch-{torch.__version__.replace('+', '-')}-{kind}"


def use_cache_root(root: str | os.PathLike[str] | None, device: torch.device) -> Path:
    """Point inductor's caches at <root>/<machine key> (root: the argument, $DFLASH_TRT_COMPILE_CACHE,
    or ~/.cache/dflash-trt/compile) unless TORCHINDUCTOR_CACHE_DIR is already set. Returns the directory."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    base = Path(root or os.environ.get(CACHE_ENV) or DEFAULT_CACHE_ROOT).expanduser()
    directory = base / machine_key(device)
    directory.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory)
    return directory


def compile_round(fn: Callable[..., Any], device: torch.device) -> Callable[..., Any]:
    """`fn` (the runner's round) through torch.compile with the options for `device`.

    Batch size 1 would otherwise get a graph of its own (torch specialises sizes of 0 and 1 by
    default): size-oblivious shapes keep it symbolic, so one graph serves every batch size. The flag
    is process-wide and only affects how later compilations treat sizes of 1."""
    import torch
    import torch.fx.experimental._config as fx_config

    fx_config.backed_size_oblivious = os.environ.get("OBL", "1") == "1"
    return torch.compile(fn, dynamic=True)
