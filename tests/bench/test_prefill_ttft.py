# SPDX-License-Identifier: Apache-2.0
"""bench/prefill_ttft.py: bad arguments are refused by name before anything heavy loads. (A run needs
every compiled class of a bundle, minutes to compile; its results are in bench/results/prefill-*.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "prefill_ttft.py"


@pytest.mark.parametrize(
    ("args", "named"), [(["--repeats", "0"], "--repeats 0"), (["--long", "-1"], "--long -1")]
)
def test_bad_arguments_exit_2_naming_the_option(tmp_path: Path, args: list[str], named: str) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--bundle", str(tmp_path), *args],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and named in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
