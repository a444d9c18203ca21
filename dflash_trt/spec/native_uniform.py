# SPDX-License-Identifier: Apache-2.0
"""The counter-based uniforms of `sampling.uniform` as dflash-trt's CPU operator
`dflash_rng::uniform` (uniform_op.cpp beside this module): the same values, bit for bit.

Why. In torch ops the hash is about forty int64 elementwise operations per call, and a sampled round
makes three or four calls; inside a compiled round inductor fuses them into large loop bodies whose
code generation made a sampled class compile ~20 s longer than its greedy twin on 2 CPU cores. The
operator is one extern call in the compiled graph: nothing to generate, a few microseconds to run.

`available()` builds and loads it at the first call (g++, torch's headers, a few seconds once per
machine and torch version: layers/native.py). The engine asks once and passes the answer to
`sampling.uniform(..., native=...)`; the compile fingerprint records it (engine/runner.py). Without a
C++ compiler or a writable kernel cache, or with DFLASH_TRT_CPU_UNIFORM=0, the torch ops are used.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dflash_trt.layers import native

SWITCH_ENV = "DFLASH_TRT_CPU_UNIFORM"  # "0": the hash in torch ops everywhere


def _fakes() -> None:
    @torch.library.register_fake("dflash_rng::uniform")
    def _(seeds: torch.Tensor, positions: torch.Tensor, purpose: int) -> torch.Tensor:
        return positions.new_empty(positions.shape, dtype=torch.float32)


_OP = native.TorchOp(Path(__file__).with_name("uniform_op.cpp"), SWITCH_ENV, "CPU uniform operator", "torch ops",
                     fakes=_fakes)  # fmt: skip


def available() -> bool:
    """Whether `dflash_rng::uniform` runs here: the switch, and the operator built and loaded."""
    return _OP.available()
