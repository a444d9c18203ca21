# SPDX-License-Identifier: Apache-2.0
"""Building dflash-trt's own CPU code (the C kernels and C++ torch operators beside this module) into
shared libraries, at first use, into a per-machine cache.

The cache is $DFLASH_TRT_KERNEL_CACHE or ~/.cache/dflash-trt/kernels; an engine with compiled rounds
points it at its compile cache (engine/compile.py `point_kernels_at`), so that the servers of a bundle
share the libraries with the rounds that call them. A library is named by a digest of its source, its
flags, the compiler's version (and, for a torch operator, torch's version), so an edit or an upgrade
builds a new one; one already in ~/.cache/dflash-trt/kernels is copied rather than built again. It is
written to a temporary name and renamed: concurrent processes never load half a file.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

CACHE_ENV = "DFLASH_TRT_KERNEL_CACHE"
DEFAULT_CACHE = Path("~/.cache/dflash-trt/kernels")


def compiler(env: str, names: tuple[str, ...], missing: str) -> str:
    """$env, else the first of `names` on PATH; RuntimeError(missing) when there is none."""
    found = os.environ.get(env) or next((c for c in names if shutil.which(c)), None)
    if found is None or shutil.which(found) is None:
        raise RuntimeError(missing)
    return found


def compiled_library(
    compiler: str, source: Path, flags: Sequence[str], libs: Sequence[str] = (), salt: bytes = b""
) -> Path:
    """`source` built into a shared library in the kernel cache, under a digest of the source, the
    flags, the compiler's version and `salt`: from the cache, copied from ~/.cache/dflash-trt/kernels,
    or compiled now (and then copied there too)."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    digest = hashlib.sha256(source.read_bytes() + repr(flags).encode() + version.encode() + salt)
    root = Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()
    name = f"{source.stem}-{digest.hexdigest()[:16]}.so"
    path, user = root / name, DEFAULT_CACHE.expanduser() / name
    if path.is_file():
        return path
    if user != path and user.is_file():  # built earlier into the user's cache: a copy will do
        _place(path, lambda tmp: shutil.copyfile(user, tmp))
        return path

    def build(tmp: str) -> None:
        done = subprocess.run([compiler, *flags, str(source), "-o", tmp, *libs], capture_output=True, text=True,
                              timeout=600)  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(
                f"{compiler} failed: {done.stderr.strip().splitlines()[-1:] or done.returncode}"
            )

    _place(path, build)
    log.info("built dflash_trt's CPU code: %s", path)
    if user != path:  # and into the user's cache, for the next cache that lacks it (best effort)
        with contextlib.suppress(OSError):
            _place(user, lambda tmp: shutil.copyfile(path, tmp))
    return path


def _place(path: Path, make: Callable[[str], object]) -> None:
    """make(tmp) writes the file; it then becomes `path` at once (a rename in the same directory)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-", suffix=path.suffix)
    os.close(fd)
    try:
        make(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def torch_op_library(source: Path, isa_flags: Sequence[str], includes: Sequence[Path] = ()) -> Path:
    """A C++ torch operator's shared library (g++ or $CXX, torch's headers and libraries, `isa_flags`
    such as -mavx512f): from the cache, or built now (~10-20 s, once per source, torch and compiler).
    `includes`: the files the source includes from beside it (their text is part of the cache key)."""
    import torch
    from torch.utils import cpp_extension

    cxx = compiler("CXX", ("g++", "c++"), "no C++ compiler on PATH (set CXX or install g++)")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = ["-O3", *isa_flags, "-std=c++17", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-w"]
    flags += [f"-I{p}" for p in cpp_extension.include_paths()]
    libs = [f"-L{p}" for p in cpp_extension.library_paths()] + ["-lc10", "-ltorch", "-ltorch_cpu"]
    salt = torch.__version__.encode() + b"".join(p.read_bytes() for p in includes)
    return compiled_library(cxx, source, flags, libs, salt)


class TorchOp:
    """One of dflash-trt's C++ torch operators, built at first use. `available()` reads its switch
    (`switch_env=0`: the torch path everywhere), then, once per process, builds and loads the library
    (`torch_op_library`) and registers the operator's fake implementations (`fakes`, what torch.compile
    traces instead of running it). isa_flags: the compiler flags for this CPU, asked at the build.
    includes: the files beside the source that it includes. Where it cannot be built or loaded, one
    warning names `what` and the `fallback` used instead."""

    def __init__(self, source: Path, switch_env: str, what: str, fallback: str, *, fakes: Callable[[], object],
                 isa_flags: Callable[[], Sequence[str]] = tuple, includes: Sequence[str] = ()) -> None:  # fmt: skip
        self.source, self.switch_env, self.what, self.fallback = source, switch_env, what, fallback
        self.fakes, self.isa_flags = fakes, isa_flags
        self.includes = [source.with_name(name) for name in includes]
        self._loaded: bool | None = None

    def available(self) -> bool:
        if os.environ.get(self.switch_env, "1") == "0":
            return False
        if self._loaded is None:
            self._loaded = self._load()
        return self._loaded

    def _load(self) -> bool:
        import torch

        try:
            torch.ops.load_library(str(torch_op_library(self.source, self.isa_flags(), self.includes)))
        except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
            log.warning("dflash_trt's %s is unavailable (%s); using %s", self.what, exc, self.fallback)
            return False
        self.fakes()
        return True
