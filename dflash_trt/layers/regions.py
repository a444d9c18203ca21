# SPDX-License-Identifier: Apache-2.0
"""Repeated regions: a decoder layer is compiled once per graph and reused by every layer.

A compiled round holds every layer of the target and the drafter, and each one went through dynamo,
AOT autograd and inductor's code generation again although all of them run the same code on weights
of the same shapes. `repeated_region` marks a layer's forward as torch.compile's nested compile
region: the first layer is traced and compiled, the others call the same compiled subgraph with their
own weights (inductor then cannot fuse across a layer boundary: the residual add of one layer and the
next one's norm stay two kernels). Eager code is unchanged: outside torch.compile the mark does
nothing. On a torch without nested compile regions the layers are compiled one by one as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


def repeated_region(fn: F) -> F:
    """Mark `fn` (a layer's forward) as a region that torch.compile compiles once and reuses."""
    mark = getattr(torch.compiler, "nested_compile_region", None)
    return fn if mark is None else mark(fn)
