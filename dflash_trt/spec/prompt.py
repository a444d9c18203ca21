# SPDX-License-Identifier: Apache-2.0
"""What a prompt must satisfy before any model sees it: the rule shared by the engine's
`add_request` and the reference loop."""

from __future__ import annotations

from collections.abc import Sequence

from dflash_trt.errors import RequestError


def check_prompt_ids(prompt_ids: Sequence[int], vocab_size: int) -> None:
    """Raise RequestError unless the prompt is non-empty and every id is a row of the embedding."""
    if not prompt_ids:
        raise RequestError("prompt is empty", field="prompt", hint="send at least one token or character")
    for i, tok in enumerate(prompt_ids):
        if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab_size:
            raise RequestError(
                f"prompt_ids[{i}]={tok!r}: out of range for vocab_size={vocab_size}",
                field="prompt",
                hint=f"use token ids in [0, {vocab_size})",
            )
