# SPDX-License-Identifier: Apache-2.0
"""Where dflash-trt's own operator libraries live (layers/native.py): beside the compiled rounds that
call them when an engine compiles (engine/compile.py `point_kernels_at`), so that the servers of a
bundle whose cache `precompile` filled load them instead of building them; a library already built
into the user's cache is copied, not built again."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from dflash_trt.engine import compile as compile_mod
from dflash_trt.layers import native

CPU = torch.device("cpu")


def _logging_compiler(tmp_path: Path) -> tuple[str, Path]:
    """A C compiler that appends each command line to a log, then runs the real one."""
    real = shutil.which("gcc") or shutil.which("cc")
    assert real is not None, "dflash-trt's CPU operators need a C compiler (gcc or cc on PATH)"
    log = tmp_path / "calls.log"
    script = tmp_path / "cc-logged"
    script.write_text(f'#!/bin/sh\necho "$*" >> {log}\nexec {real} "$@"\n')
    script.chmod(0o755)
    return str(script), log


def test_a_library_is_built_once_and_copied_into_other_caches(tmp_path, monkeypatch) -> None:
    cc, log = _logging_compiler(tmp_path)
    source = tmp_path / "probe_kernel.c"
    source.write_text("int dflash_probe(int x) { return 2 * x + 1; }\n")
    user = tmp_path / "user"
    monkeypatch.setattr(native, "DEFAULT_CACHE", user)
    flags = ["-O2", "-shared", "-fPIC"]

    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "bundle-a"))
    built = native.compiled_library(cc, source, flags)
    assert built.parent == tmp_path / "bundle-a" and built.is_file()
    assert (user / built.name).read_bytes() == built.read_bytes()  # mirrored into the user's cache
    builds = [c for c in log.read_text().splitlines() if "--version" not in c]
    assert len(builds) == 1

    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "bundle-b"))
    copied = native.compiled_library(cc, source, flags)
    assert copied == tmp_path / "bundle-b" / built.name and copied.read_bytes() == built.read_bytes()
    assert [c for c in log.read_text().splitlines() if "--version" not in c] == builds  # no second build
    assert sorted(p.name for p in copied.parent.iterdir()) == [built.name]  # no temporary file left
    assert native.compiled_library(cc, source, flags) == copied  # and from now on found in place


def test_compiling_engines_keep_their_kernels_beside_their_rounds(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(native.CACHE_ENV, raising=False)  # restored (unset) after the test
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    first = compile_mod.use_cache_root(tmp_path / "one", CPU)
    assert os.environ[native.CACHE_ENV] == str(first / compile_mod.KERNELS_DIR)
    second = compile_mod.use_cache_root(tmp_path / "two", CPU)  # another engine's root: followed
    assert os.environ[native.CACHE_ENV] == str(second / compile_mod.KERNELS_DIR)
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "mine"))  # the user's choice: kept
    compile_mod.use_cache_root(tmp_path / "three", CPU)
    assert os.environ[native.CACHE_ENV] == str(tmp_path / "mine")
