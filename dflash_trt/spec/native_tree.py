# SPDX-License-Identifier: Apache-2.0
"""DDTree's best-first tree as dflash-trt's CPU operator `dflash_tree::best_first` (tree_op.cpp beside
this module): the nodes of `tree.best_first_tree`, in its order, for a whole batch, with the visibility
mask.

Why. A CPU round at batch 1 on a small model is mostly fixed cost per operator, and the batched builder
(`tree.build_tree`: g - 1 dependent top-k steps, a sort, a scatter, pointer chasing for the mask) cost
~0.3 ms of a ~2.5 ms compiled round on `tiny`; the Python heap (`tree.build_tree_host`) is no cheaper
and cannot run inside a compiled round. The operator is one extern call, eager or compiled, of a few
microseconds. The top-k of each depth stays in torch (`tree.depth_candidates`), so the scores it sums
are the batched builder's.

`available()` builds and loads it at the first call (g++, torch's headers, a few seconds once per
machine and torch version: layers/native.py). The engine asks once, on CPU; the compile fingerprint
records the answer (engine/runner.py). Without a C++ compiler or a writable kernel cache, or with
DFLASH_TRT_CPU_TREE=0, the torch builders are used.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dflash_trt.layers import native

SWITCH_ENV = "DFLASH_TRT_CPU_TREE"  # "0": the torch tree builders everywhere


def _fakes() -> None:
    @torch.library.register_fake("dflash_tree::best_first")
    def _(
        top_lp: torch.Tensor, top_tok: torch.Tensor, anchors: torch.Tensor, budget: int
    ) -> tuple[torch.Tensor, ...]:
        bs, n1 = top_lp.shape[0], budget + 1
        long = anchors.new_empty((bs, n1))
        flag = anchors.new_empty((bs, n1), dtype=torch.bool)
        return long, long.clone(), long.clone(), flag, anchors.new_empty((bs, n1, n1), dtype=torch.bool)


_OP = native.TorchOp(Path(__file__).with_name("tree_op.cpp"), SWITCH_ENV, "CPU tree builder", "torch ops",
                     fakes=_fakes)  # fmt: skip


def available() -> bool:
    """Whether `dflash_tree::best_first` runs here: the switch, and the operator built and loaded."""
    return _OP.available()
