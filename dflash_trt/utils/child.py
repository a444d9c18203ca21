# SPDX-License-Identifier: Apache-2.0
"""The command line of a child process that runs one of dflash_trt's modules with this very copy of
dflash_trt (the engine process, the background compiler and its helpers)."""

from __future__ import annotations

import sys
from pathlib import Path

# The directory that holds the dflash_trt package this process imported (a checkout or site-packages).
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


def module_command(module: str, *args: str) -> list[str]:
    """`python -m module args`, except that the child imports the dflash_trt this process runs.

    `python -m` puts the child's working directory first on sys.path, so a checkout of another version
    there would be imported instead: a parent started from a worktree through PYTHONPATH got children
    that ran (and, for the compiler, fingerprinted and compiled) the code in the working directory.
    Here the package root takes that first place."""
    code = (
        f"import runpy, sys; sys.path[0] = {PACKAGE_ROOT!r}; "
        f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"
    )
    return [sys.executable, "-c", code, *args]
