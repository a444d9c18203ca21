# SPDX-License-Identifier: Apache-2.0
"""The command line and environment of a child process that runs one of dflash_trt's modules with this
very copy of dflash_trt (the engine process, the background compiler and its helpers).

libgomp's idle spin. torch's CPU build runs its parallel regions on libgomp, whose idle workers spin
GOMP_SPINCOUNT times (300,000 unless set: milliseconds) after a region before they sleep, or only 100
times while the process holds more libgomp threads than cores. dflash-trt's GEMM team
(layers/spin_team.h) needs that core between a prefill's regions. A serving engine's thread is in the
short case (the thread that loaded the models holds a pool too); the warm-up, which runs on the loading
thread before the engine thread exists, is not: smollm2-135m's 16 throwaway batches took 2.5-3.1 s on
it against 0.66 s with the spin at 1,000 (bench/README.md, "Warm start"). libgomp reads the variable
once, when torch loads it: the processes dflash-trt starts get it in their environment (`child_env`;
the CLI sets its own with `limit_openmp_spin`), never over a value the user set."""

from __future__ import annotations

import os
import sys
from pathlib import Path

OPENMP_SPIN_ENV = "GOMP_SPINCOUNT"
OPENMP_SPIN = "1000"  # iterations an idle libgomp worker spins before it sleeps (module docstring)

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


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child that runs an engine: libgomp's spin limited unless the
    user set it (module docstring), plus `extra`."""
    env = {**os.environ, **extra}
    env.setdefault(OPENMP_SPIN_ENV, OPENMP_SPIN)
    return env


def limit_openmp_spin() -> None:
    """Limit libgomp's spin in this process (module docstring), unless the user set it. Takes effect
    only before torch is imported."""
    os.environ.setdefault(OPENMP_SPIN_ENV, OPENMP_SPIN)
