# SPDX-License-Identifier: Apache-2.0
"""utils.jsonl: the one JSON Lines reader (bench --dataset, train-drafter --data)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_trt.errors import UsageError
from dflash_trt.utils.jsonl import iter_jsonl


def test_yields_values_with_line_numbers_and_skips_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_text('{"a": 1}\n\n   \n[2, 3]\n"s"\n')
    assert list(iter_jsonl(path, name="--x", hint="h")) == [(1, {"a": 1}), (4, [2, 3]), (5, "s")]


def test_bad_line_names_the_file_flag_and_line(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_text('{"a": 1}\n\n{oops\n')
    with pytest.raises(UsageError, match=r"^--x=f: line 3 is not JSON \(.+\); fix: one per line$"):
        list(iter_jsonl(path, name="--x=f", hint="one per line"))
