# SPDX-License-Identifier: Apache-2.0
"""dflash::tree_attention's Triton kernel against its reference, interpreted on CPU tensors.

Run by test_interpreter.py (child pytest with TRITON_INTERPRET=1 set before triton is imported).
Run directly:  TRITON_INTERPRET=1 pytest tests/plugins/tree_kernels_interpreted.py
"""

from __future__ import annotations

import os
import zlib

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - collected by hand without the variable
    raise RuntimeError(
        "tree_kernels_interpreted.py needs TRITON_INTERPRET=1 before triton is imported: run it as "
        "`TRITON_INTERPRET=1 pytest tests/plugins/tree_kernels_interpreted.py` (test_interpreter.py does)"
    )

import torch
import triton  # noqa: F401  (a dev dependency; imported here, after the variable is set)

from dflash_trt.plugins import load_ops, tree_attention
from tests.plugins import tree_cases
from tests.plugins.conftest import triton_on_cpu

pytestmark = pytest.mark.triton_interpret
load_ops()


def test_the_tree_kernel_is_interpreted():
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(tree_attention._tree_attn_kernel, InterpretedFunction)


@pytest.mark.parametrize("case", tree_cases.TREE_CASES, ids=str)
def test_tree_attention_matches_reference(case):
    args = tree_cases.tree_inputs(case, seed=zlib.crc32(str(case).encode()) % 1000)
    want = tree_attention.tree_attention_reference(*args).float()
    tol = 1e-5 if case.dtype == torch.float32 else 2e-3
    for splits, block_n in ((1, 16), (3, 16), (None, 64)):
        got = tree_attention.launch_tree_attention(*args, num_splits=splits, block_n=block_n)
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_more_splits_than_context_keys():
    args = tree_cases.tree_inputs(tree_cases.TreeCase(2, 5, 3, 4, 2, 12, 4, sinks=True), seed=4)
    want = tree_attention.tree_attention_reference(*args)
    got = tree_attention.launch_tree_attention(*args, num_splits=7, block_n=16)  # most splits empty
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_op_runs_the_kernel_on_cpu_under_the_switch(monkeypatch):
    args = tree_cases.tree_inputs(tree_cases.TREE_CASES[1], seed=2)
    calls = []
    launch = tree_attention.launch_tree_attention

    def spy(*a, **kw):
        calls.append(1)
        return launch(*a, **kw)

    monkeypatch.setattr(tree_attention, "launch_tree_attention", spy)
    with triton_on_cpu():
        got = torch.ops.dflash.tree_attention(*args)
    assert calls == [1]
    torch.testing.assert_close(got, tree_attention.tree_attention_reference(*args), atol=1e-5, rtol=1e-5)
