# SPDX-License-Identifier: Apache-2.0
"""Runs dflash2_kernels_interpreted.py in a child pytest with TRITON_INTERPRET=1 (see
test_interpreter.py for why a child process); its JUnit report must show tests that ran and none that
failed or skipped."""

from __future__ import annotations

import pytest

from tests.plugins.test_interpreter import run_interpreted


@pytest.mark.triton_interpret
def test_dflash2_kernels_under_the_interpreter(tmp_path):
    run_interpreted(("dflash2_kernels_interpreted.py",), tmp_path, min_tests=30)
