# SPDX-License-Identifier: Apache-2.0
"""The DFlash drafting plugin: `dflash::` torch custom ops with OpenAI-Triton CUDA kernels.

  dflash::inject_context    context-KV injection for newly committed tokens (context_kv.py)
  dflash::block_attention   B block queries over [paged context ; block], GQA, sliding window
                            (block_attention.py)
  dflash::greedy_accept     greedy verification (accept.py)
  dflash::rejection_accept  lossless rejection-sampling verification (accept.py)
  dflash::tree_attention    the target's attention over [paged context ; DDTree nodes] under the
                            ancestor mask (tree_attention.py)

Each op's default implementation is its PyTorch reference (CPU); CUDA tensors dispatch to the
Triton launcher. Importing this package imports neither torch nor triton: `load_ops()` registers the
ops (importing torch, and triton when installed), `drafting.py` is the engine glue.
See README.md in this directory for contracts, fusion boundaries and test status.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

OP_MODULES = ("context_kv", "block_attention", "accept", "tree_attention")


def triton_installed() -> bool:
    """Whether OpenAI Triton can be imported (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def default_enabled(device: Any) -> bool:
    """The engine's default for `use_plugins`: on for CUDA devices when Triton is installed."""
    return getattr(device, "type", str(device)) == "cuda" and triton_installed()


def load_ops() -> None:
    """Register every dflash:: op (idempotent)."""
    for name in OP_MODULES:
        importlib.import_module(f"{__name__}.{name}")


def __getattr__(name: str) -> Any:  # PEP 562: submodules on first use
    if name in (*OP_MODULES, "drafting", "_registry"):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
