# SPDX-License-Identifier: Apache-2.0
"""Penalties, logit bias and min-p: what a request may do to the target's distribution before it is
sampled (or its argmax taken), and the one place their rules and ranges live.

At a position whose sequence so far holds the prompt P and the generated tokens O (the drafts a round
accepted before that position included), the raw logits l become, in this order:
  1. repetition_penalty r: for every token in P or O, l / r where l > 0, l * r otherwise
     (transformers' and vLLM's rule; r = 1 is off);
  2. frequency_penalty f and presence_penalty p: l - f * count_O(t) - p * [count_O(t) > 0] (OpenAI's rule:
     generated tokens only);
  3. logit_bias: l + bias[t];
  4. bad words: a word's last token is -inf wherever the sequence so far ends with its other tokens
     (always, for a one-token word: TensorRT-LLM's `bad` / `bad_token_ids`);
then temperature, and min_p m: a token whose tempered probability is below m times the largest one is
dropped (before top-k and top-p). Greedy requests take the argmax of steps 1-3.

DFlash stays lossless under them: the round verifies position j with the counts the sequence would have
there (its committed tokens plus the drafts 0..j-1 of the block), which are exactly right whenever
position j's distribution is used at all, since that needs every draft before it accepted.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dflash_trt.errors import ConfigError

MAX_BIAS = 100.0  # OpenAI's range for logit_bias values
MAX_PENALTY = 2.0  # OpenAI's range for presence and frequency penalties: [-2, 2]
MAX_BAD_WORDS = 256  # bad words a request may name
MAX_BAD_WORD_TOKENS = 16  # tokens in one bad word
ANY_TOKEN = -1  # in a bad word's right-aligned prefix: no token to match (and a row's unused words)
NO_TOKEN = -2  # in a sequence's latest tokens: before its start


def validate_penalties(*, presence_penalty: Any, frequency_penalty: Any, repetition_penalty: Any, min_p: Any,
                       logit_bias: Any, vocab_size: int) -> None:  # fmt: skip
    """Each value's range; raises ConfigError naming the field."""
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if not _number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise ConfigError(name, value, f"must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]",
                              hint="send 0 (off) or a value in range")  # fmt: skip
    if not _number(repetition_penalty) or repetition_penalty <= 0:
        raise ConfigError(
            "repetition_penalty", repetition_penalty, "must be a number > 0", hint="send 1 (off) or more"
        )
    if not _number(min_p) or not 0 <= min_p <= 1:
        raise ConfigError(
            "min_p", min_p, "must be a number in [0, 1]", hint="send 0 (off) or a value in [0, 1]"
        )
    for token, bias in logit_bias:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise ConfigError("logit_bias", token, f"token id out of range for vocab_size={vocab_size}",
                              hint=f"use token ids in [0, {vocab_size})")  # fmt: skip
        if not _number(bias) or not -MAX_BIAS <= bias <= MAX_BIAS:
            raise ConfigError("logit_bias", bias, f"bias for token {token} must be in [-100, 100]",
                              hint="send values in [-100, 100]")  # fmt: skip


def validate_bad_words(bad_words: Any, vocab_size: int) -> None:
    """Bad words as token-id sequences: how many, how long, ids in the vocabulary; ConfigError naming
    `bad_words`."""
    if len(bad_words) > MAX_BAD_WORDS:
        raise ConfigError("bad_words", len(bad_words), f"more than {MAX_BAD_WORDS} words",
                          hint=f"send at most {MAX_BAD_WORDS}")  # fmt: skip
    for word in bad_words:
        if not 1 <= len(word) <= MAX_BAD_WORD_TOKENS:
            raise ConfigError("bad_words", list(word), f"a word must be 1 to {MAX_BAD_WORD_TOKENS} tokens",
                              hint="split or drop it")  # fmt: skip
        for t in word:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise ConfigError("bad_words", t, f"token id out of range for vocab_size={vocab_size}",
                                  hint=f"use token ids in [0, {vocab_size})")  # fmt: skip


def ban_bad_words(scores: torch.Tensor, windows: torch.Tensor, prefixes: torch.Tensor,
                  lasts: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """Step 4. scores [bs, n, V]; windows [bs, n, W]: the W tokens before each position (-2 where the
    sequence has none); prefixes [bs, NB, W]: each word but its last token, right-aligned (-1: any
    token); lasts [bs, NB]: each word's last token (-1: no word) -> scores with the banned tokens -inf,
    in place. (-2 and -1 are NO_TOKEN and ANY_TOKEN.) Only the words' last tokens are touched: a minimum
    with -inf where a word completes, with +inf elsewhere (exact however many words share a token)."""
    same = (windows[:, :, None, :] == prefixes[:, None]) | (prefixes[:, None] == ANY_TOKEN)
    match = same.all(dim=-1) & (lasts[:, None, :] >= 0)  # [bs, n, NB]
    fill = torch.where(match, -math.inf, math.inf).to(scores.dtype)
    return scores.scatter_reduce_(2, lasts.clamp(min=0)[:, None, :].expand_as(match), fill, reduce="amin")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def penalize(
    logits: torch.Tensor,
    counts: torch.Tensor,  # float: generated tokens so far
    seen: torch.Tensor,  # bool: tokens of the prompt or generated so far
    bias: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """Steps 1-3 of the module docstring, elementwise -> float32 logits. Every argument broadcasts
    against `logits` (e.g. [N, V] logits with [N, 1] penalties, or the few tokens a caller picked);
    the one place the rule is written."""
    scores = logits.float()
    r = repetition.float()
    scores = torch.where(seen, torch.where(scores > 0, scores / r, scores * r), scores)
    scores = scores - frequency.float() * counts - presence.float() * (counts > 0).float()
    return scores + bias


def min_p_mask(scores: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Tempered scores [N, V] -> the same with tokens below min_p times the top probability at -inf.
    min_p 0 keeps every token."""
    probs = torch.softmax(scores, dim=-1)
    floor = min_p.float()[:, None] * probs.max(dim=-1, keepdim=True).values
    return scores.masked_fill(probs < floor, float("-inf"))
