# SPDX-License-Identifier: Apache-2.0
"""Inductor's CPU vector-ISA probe, trusted once it has passed on this machine.

Before inductor loads or compiles CPU code it checks each vector ISA the CPU's flags name (AVX-512
with VNNI, AVX-512, AVX2 on the Zen 4 and Xeon machines here): it builds a small C++ file with that
ISA's flags and starts a child Python that dlopens the library. The builds are cached, the child is
not: ~1 s of every process that loads compiled rounds (the engine, the background compiler, each
helper), on a warm start of 10-15 s (bench/README.md, "Warm start").

The outcome depends on torch, the CPU's flags and the compiler, and the first two name the compile
cache's machine directory (engine/compile.py `machine_key`). So a process that saw every candidate
pass writes `vec-isa.json` there (`record`), and later processes with the same candidates set
inductor's `cpp.vec_isa_ok` instead of probing (`trust`): the ISA inductor then picks is the one the
probe would have picked. A user's TORCHINDUCTOR_VEC_ISA_OK wins, and a probe that failed anywhere is
never recorded, so such machines keep probing. A compiler that no longer builds what it built before
fails the class's compile, which serves eagerly with a warning (api/llm.py), as any compile failure.
"""

from __future__ import annotations

import json
import logging
import platform
import sys
from pathlib import Path

from dflash_trt.utils.io import atomic_write_text

log = logging.getLogger(__name__)

RECORD_NAME = "vec-isa.json"
_recorded: set[Path] = set()  # machine directories this process has recorded (at most once each)


def candidates() -> list[str] | None:
    """The ISAs inductor would probe on this CPU, best first; None where it probes differently
    (not x86-64 Linux): those machines always probe."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return None
    try:  # inductor's own names (torch 2.13): another torch without them probes as it always did
        from torch._inductor.cpu_vec_isa import supported_vec_isa_list, x86_isa_checker
    except ImportError:
        return None
    flags = x86_isa_checker()
    return [str(isa) for isa in supported_vec_isa_list if all(f in flags for f in str(isa).split())]


def trust(directory: Path) -> bool:
    """Skip the probe when `directory` (a machine's compile cache) records that every candidate passed.
    Returns whether inductor now trusts the ISAs."""
    import torch._inductor.config as inductor_config

    if inductor_config.cpp.vec_isa_ok is not None:  # the user's setting, or already trusted
        return bool(inductor_config.cpp.vec_isa_ok)
    try:
        seen = json.loads((directory / RECORD_NAME).read_text()).get("passed")
    except (OSError, ValueError, AttributeError):
        return False
    if not seen or seen != candidates():
        return False
    inductor_config.cpp.vec_isa_ok = True
    log.info(
        "inductor's ISA probe skipped: %s passed it on this machine before (%s)",
        seen,
        directory / RECORD_NAME,
    )
    return True


def record(directory: Path) -> None:
    """Note in `directory` that every candidate ISA passed inductor's probe in this process. Call it
    after a round was loaded or compiled (the probe has run then; otherwise this runs it)."""
    import torch._inductor.config as inductor_config

    if directory in _recorded or inductor_config.cpp.vec_isa_ok is not None:
        return
    _recorded.add(directory)
    wanted = candidates()
    if not wanted:
        return
    from torch._inductor import cpu_vec_isa

    passed = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
    if passed != wanted:
        log.info("inductor's ISA probe passed %s of %s: it runs at every start", passed, wanted)
        return
    text = json.dumps({"passed": passed}) + "\n"
    path = directory / RECORD_NAME
    if not path.is_file() or path.read_text() != text:
        atomic_write_text(path, text)
