# SPDX-License-Identifier: Apache-2.0
"""Runs kernels_interpreted.py and tree_kernels_interpreted.py in a child pytest with TRITON_INTERPRET=1.

The variable must be set before triton is first imported, and this process may already have
imported it (test_ops.py registers the ops), so the interpreted kernels get a process of their own.
The child's JUnit report must show tests that ran and none that failed or skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHILDREN = [Path(__file__).with_name(n) for n in ("kernels_interpreted.py", "tree_kernels_interpreted.py")]


@pytest.mark.triton_interpret
def test_triton_kernels_under_the_interpreter(tmp_path: Path) -> None:
    report = tmp_path / "junit.xml"
    # one OpenMP thread: the tiny GEMMs only lose to thread spinning on a shared machine
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={report}",
        *map(str, CHILDREN),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert report.is_file(), tail
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    assert suite is not None, tail
    counts = {k: int(suite.get(k, "0")) for k in ("tests", "failures", "errors", "skipped")}
    assert proc.returncode == 0, tail
    assert counts["tests"] >= 40 and counts["failures"] == counts["errors"] == counts["skipped"] == 0, (
        counts,
        tail,
    )
