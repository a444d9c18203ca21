# SPDX-License-Identifier: Apache-2.0
"""Options several commands share, declared once (the same name, type and default everywhere)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

# What --dtype auto means where a command runs a target: utils/device.resolve_dtype's policy in words
# (kept here, torch-free, for --help; tests/engine/test_defaults.py holds it to the code).
AUTO_DTYPE_HELP = (
    "auto: on CUDA the checkpoint's half dtype (else bfloat16); on a CPU with native bf16 (AVX512-BF16, AMX) "
    "a bf16 checkpoint's dtype when a step reads more than 64 MB of fp32 weights (smollm2-135m), else "
    "float32 (tiny, and every model on other CPUs)."
)
DEVICES = ("cpu", "cuda", "auto")
DTYPES = ("float32", "bfloat16", "auto")


def device_option() -> Callable[[Any], Any]:
    return click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True)


def dtype_option(help: str) -> Callable[[Any], Any]:
    """--dtype, with what `auto` means for the command."""
    return click.option("--dtype", type=click.Choice(DTYPES), default="auto", show_default=True, help=help)
