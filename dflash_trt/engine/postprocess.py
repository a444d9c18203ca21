# SPDX-License-Identifier: Apache-2.0
"""After a round: append a request's new tokens and apply its stop rules.

Stop rules, in order: a stop token id (once min_tokens are out), a stop string in the decoded text
(cut before it unless include_stop_str_in_output), and the length limit (prompt + max_tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash_trt.engine.request import Request


@dataclass
class StepUpdate:
    """One change to a request, with the request's state *as of this change* (a step can commit a
    request twice: its prefill token and its first round)."""

    req: Request
    new_token_ids: list[int]
    text_delta: str
    num_tokens: int = 0
    text_len: int = 0
    num_rounds: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_overturned_draft_tokens: int = 0
    finished: bool = False  # the request ended with this update (see req.finish_reason)


def commit_tokens(
    req: Request, new: list[int], *, tokenizer: Any | None, first: bool = False, accepted: int = 0
) -> tuple[str | None, int | str | None, list[int], str]:
    """Append `new` (truncated by the length limit and stop rules) to the request.

    first: the token sampled at the end of prefill (not a round). accepted: drafts accepted in the
    round. Returns (finish_reason or None, stop_reason, the tokens kept, the text added).
    """
    produced = len(new) if first else min(len(new), req.max_len - req.start - 1)
    finish: str | None = None
    stop_reason: int | str | None = None
    base = len(req.output_ids)
    for idx, tok in enumerate(new[:produced]):
        if tok in req.stop_token_ids and base + idx + 1 >= req.min_tokens:
            produced, finish, stop_reason = idx + 1, "stop", tok
            break
    tokens = new[:produced]
    req.output_ids.extend(tokens)
    if not first:
        req.acceptance_lengths.append(produced)
        req.num_accepted_draft_tokens += min(accepted, produced)
    old_text = req.text
    if req.detokenizer is not None:
        req.detokenizer.add(tokens)
        req.text = req.detokenizer.text
        if req.stop_strings and len(req.output_ids) >= req.min_tokens:
            cut = _find_stop(req, len(old_text))
            if cut is not None:
                finish, (stop_reason, pos) = "stop", cut
                end = pos + (len(stop_reason) if req.include_stop_str_in_output else 0)
                req.text = req.text[:end]
                assert tokenizer is not None  # a detokenizer implies a tokenizer
                req.output_ids = req.output_ids[: _tokens_covering(req, pos + len(stop_reason), tokenizer)]
                tokens = req.output_ids[base:]
    if finish is None and req.start + 1 >= req.max_len:
        finish = "length"
        if req.detokenizer is not None:
            req.detokenizer.flush()
            req.text = req.detokenizer.text
    return finish, stop_reason, tokens, req.text[len(old_text) :]


def _find_stop(req: Request, old_len: int) -> tuple[str, int] | None:
    """The earliest stop string in the text that ends in the newly decoded part."""
    best: tuple[str, int] | None = None
    for stop in req.stop_strings:
        pos = req.text.find(stop, max(0, old_len - len(stop) + 1))
        if pos >= 0 and (best is None or pos < best[1]):
            best = (stop, pos)
    return best


def _tokens_covering(req: Request, chars: int, tokenizer: Any) -> int:
    """Smallest number of output tokens whose decoded text reaches `chars` characters, decoded as
    the request's text is (with or without special tokens, as it asked)."""
    skip = req.detokenizer.skip if req.detokenizer is not None else True
    lo, hi = 1, len(req.output_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        text = tokenizer.decode(req.output_ids[:mid], skip_special_tokens=skip)
        if len(text) >= chars:
            hi = mid
        else:
            lo = mid + 1
    return lo
