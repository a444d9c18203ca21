# SPDX-License-Identifier: Apache-2.0
"""Who drafts and accepts: PyTorch, or the drafting plugin's dflash:: custom ops. Chosen once.

A round calls five things that exist in both forms: KV injection and the drafter's block pass
(`drafting.inject_context`, `drafting.forward_block`: the drafter itself, or `DrafterPlugins`),
greedy and rejection acceptance, and for a DFlash 2 drafter the selector's walk and acceptance with q
over its candidates. `make_draft_backend` picks the plugin forms where they are on (by default on CUDA
with triton installed; on a device where a kernel fails its self-check the PyTorch forms, with a
warning) and the PyTorch ones otherwise. The round reads the backend, never which one it is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dflash_trt.plugins import default_enabled
from dflash_trt.spec.accept import greedy_accept, rejection_accept, rejection_accept_candidates
from dflash_trt.spec.selector import WalkFn, selector_walk

if TYPE_CHECKING:
    import torch

    from dflash_trt.models.drafter import DFlashDrafter


@dataclass(frozen=True)
class DraftBackend:
    """The drafting and acceptance functions a round calls."""

    drafting: Any  # inject_context / forward_block: the drafter, or the plugins (None without a drafter)
    greedy_accept: Callable[..., Any]
    rejection_accept: Callable[..., Any]
    candidate_accept: Callable[..., Any]  # DFlash 2: rejection sampling with q over the candidates
    walk: WalkFn  # DFlash 2: the selector's walk over each slot's candidates
    plugins: bool = False  # the dflash:: custom ops (the compile fingerprint records it)


def make_draft_backend(
    drafter: DFlashDrafter | None, device: torch.device, use_plugins: bool | None = None
) -> DraftBackend:
    """use_plugins: True/False, or None for the default (on for CUDA when triton is installed)."""
    if use_plugins if use_plugins is not None else default_enabled(device):
        from dflash_trt.plugins import drafting

        plugins, greedy, rejection = drafting.enable_plugins(drafter, device)
        if plugins is not None:
            return DraftBackend(plugins, greedy, rejection, drafting.rejection_accept_candidates,
                                drafting.selector_walk, plugins=True)  # fmt: skip
        return DraftBackend(drafter, greedy, rejection, rejection_accept_candidates, selector_walk)
    return DraftBackend(drafter, greedy_accept, rejection_accept, rejection_accept_candidates, selector_walk)
