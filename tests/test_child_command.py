# SPDX-License-Identifier: Apache-2.0
"""utils/child.py: a child started with `module_command` imports the dflash_trt its parent runs, even
from a working directory that holds another copy (`python -m` would import that one)."""

from __future__ import annotations

import subprocess
import sys

import dflash_trt
from dflash_trt.utils.child import module_command


def test_the_child_imports_this_copy_not_the_one_in_its_working_directory(tmp_path) -> None:
    decoy = tmp_path / "dflash_trt"
    decoy.mkdir()
    (decoy / "__init__.py").write_text(
        "raise SystemExit('the decoy in the working directory was imported')\n"
    )
    (decoy / "__main__.py").write_text("")
    plain = subprocess.run([sys.executable, "-m", "dflash_trt", "--version"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=60)  # fmt: skip
    assert plain.returncode != 0 and "decoy" in plain.stderr  # what `python -m` does there

    done = subprocess.run(module_command("dflash_trt", "--version"), cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert dflash_trt.__version__ in done.stdout
