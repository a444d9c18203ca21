# SPDX-License-Identifier: Apache-2.0
"""Compiled rounds: when torch.compile can run here, its options, and where its artifacts live.

The whole round (both models, the sampling and the acceptance) goes through inductor as one graph:
on CPU its elementwise work becomes fused C++ loops and the GEMMs stay MKL/oneDNN calls, which
removes most of the per-operator cost that dominates small models. Shapes are dynamic (batch,
context pages): one graph per sampling mode serves every batch size (batch 1 usually gets one of
its own). `LLMEngine.warm_up` compiles greedy and sampled rounds at batch 1 and 2 before traffic;
after it, a shape class without a graph runs eagerly rather than stalling serving to compile
(`ModelRunner.freeze_compiled`). Requests with top-k/top-p filtering are such a class today.

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
    or ~/.cache/dflash-trt/compile) unless the user set TORCHINDUCTOR_CACHE_DIR (torch writes its own
    default there on first use: that one is replaced). Returns the directory."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    preset = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if preset and os.path.abspath(preset) != os.path.abspath(default_cache_dir()):
        return Path(preset)
    base = Path(root or os.environ.get(CACHE_ENV) or DEFAULT_CACHE_ROOT).expanduser()
    directory = base / machine_key(device)
    directory.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory)
    return directory


def compile_round(fn: Callable[..., Any], device: torch.device) -> Callable[..., Any]:
    """`fn` (the runner's round) through torch.compile with dynamic shapes. Call it inside
    `shape_rules()`, where compilation happens (on the first call of each shape class)."""
    import torch

    return torch.compile(fn, dynamic=True)


def shape_rules() -> Any:
    """The symbolic-shape rules the round is compiled and guarded under: sizes of 1 (a batch of one,
    a context of one page) stay symbolic instead of being specialised, so the general graph serves
    them. A context manager (torch's setting is process-wide: it is set only around our calls, so
    other torch.compile users in the process keep torch's defaults)."""
    import torch.fx.experimental._config as fx_config

    return fx_config.patch(backed_size_oblivious=True)  # type: ignore[attr-defined]
