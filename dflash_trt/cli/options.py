# SPDX-License-Identifier: Apache-2.0
"""Options several commands share, declared once (the same name, type and default everywhere)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

DEVICES = ("cpu", "cuda", "auto")
DTYPES = ("float32", "bfloat16", "auto")


def device_option() -> Callable[[Any], Any]:
    return click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True)


def dtype_option(help: str) -> Callable[[Any], Any]:
    """--dtype, with what `auto` means for the command."""
    return click.option("--dtype", type=click.Choice(DTYPES), default="auto", show_default=True, help=help)
