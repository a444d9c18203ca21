# SPDX-License-Identifier: Apache-2.0
"""Argument checks shared by the benchmark scripts in this folder (they import it by name: a script's
own folder is first on its path)."""

from __future__ import annotations

import argparse


def positive_ints(p: argparse.ArgumentParser, flag: str, text: str) -> list[int]:
    """`text` as comma-separated integers >= 1, or exit 2 through `p` naming the flag and the value."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        p.error(f"{flag} {text!r}: give positive integers separated by commas, e.g. 1,8")
    return values
