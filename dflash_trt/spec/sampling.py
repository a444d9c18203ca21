# SPDX-License-Identifier: Apache-2.0
"""Sampling shared by target and drafter: temperature, top-k, top-p, and counter-based randomness.

Randomness is a pure function of (request seed, absolute position, purpose). A request therefore
samples the same tokens whatever else is in the batch, nothing syncs with the host, and every
uniform used in a decision is used once (positions re-drafted after a rejection were never read
by an acceptance decision, see `verify.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dflash_trt.errors import ConfigError
from dflash_trt.spec.penalties import min_p_mask

# What a uniform is for; part of the random key.
PURPOSE_DRAFT = 0  # draw d_j ~ q_j
PURPOSE_ACCEPT = 1  # the u in "accept iff u * q < p"
PURPOSE_EMIT = 2  # the token the target emits: correction, bonus or plain sample

_M32 = 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class SamplingConfig:
    """Per-request sampling. temperature 0 is greedy (then top_p/top_k are ignored)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    greedy_draft: bool = False  # at T > 0, propose greedy drafts (one-hot rule; DFlash 2: the selector's best) instead of sampling q

    def __post_init__(self) -> None:
        validate_sampling(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ConfigError("seed", self.seed, "must be an integer")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


def validate_sampling(*, temperature: float, top_p: float, top_k: int) -> None:
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise ConfigError(
            "temperature", temperature, "must be a finite number >= 0", hint="send 0 (greedy) or more"
        )
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ConfigError("top_p", top_p, "must be in (0, 1]", hint="send a value in (0, 1]; 1 = off")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ConfigError("top_k", top_k, "must be an integer >= 0", hint="send 0 (off) or more")


def logits_to_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    *,
    needs_filter: bool | None = None,
    any_greedy: bool | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits: [N, V]; temperature/top_k/top_p (and min_p, when given): [N] -> probs [N, V] float32.

    Rows with temperature 0 become one-hot at the argmax, so greedy falls out of the same
    acceptance rule. `needs_filter` / `any_greedy` may be given by callers that know them from the
    request parameters, so the function never synchronises with the host (CUDA graphs). Otherwise: divide by T, keep the top-k logits, softmax, then keep the
    smallest prefix of the sorted distribution whose mass before each kept token is < top_p,
    and renormalise (the order and tie rules of the authors' reference).
    """
    scores = logits.float()
    vocab = scores.shape[-1]
    greedy = temperature <= 0
    safe_t = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    scores = scores / safe_t[:, None]
    if min_p is not None:  # before top-k and top-p (spec/penalties.py)
        scores = min_p_mask(scores, min_p)
    if needs_filter is None:  # host sync; callers that know their requests pass the flags
        needs_filter = bool(((top_k > 0) & (top_k < vocab)).any()) or bool((top_p < 1).any())
    if any_greedy is None:
        any_greedy = bool(greedy.any())
    if needs_filter:
        sorted_scores, order = scores.sort(dim=-1, descending=True)  # [N, V]
        ranks = torch.arange(vocab, device=scores.device)[None, :]
        k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))
        sorted_scores = sorted_scores.masked_fill(ranks >= k[:, None], float("-inf"))
        sorted_probs = torch.softmax(sorted_scores, dim=-1)
        keep = (sorted_probs.cumsum(dim=-1) - sorted_probs) < top_p.float()[:, None]
        sorted_probs = sorted_probs * keep
        sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
        probs = torch.zeros_like(sorted_probs).scatter(-1, order, sorted_probs)
    else:
        probs = torch.softmax(scores, dim=-1)
    if any_greedy:
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser in int64 arithmetic (all products stay below 2**63)."""
    x = x & _M32
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _M32
    x = ((x ^ (x >> 15)) * 0x31848BAB) & _M32
    x = ((x ^ (x >> 16)) * 0x2C1B3C6D) & _M32
    return x ^ (x >> 15)


def uniform(
    seeds: torch.Tensor, positions: torch.Tensor, purpose: int, *, native: bool = False
) -> torch.Tensor:
    """Counter-based uniforms in (0, 1).

    seeds: [N] int64 (one per request); positions: [N, ...] int64 absolute token positions.
    Returns float32 [N, ...]; 24 bits of resolution, strictly inside (0, 1).
    native: on CPU, compute them with dflash-trt's operator (`native_uniform.available()` said it runs
    here): the same values, one extern call in a compiled round instead of ~40 fused integer ops.
    """
    if native and positions.device.type == "cpu":
        return torch.ops.dflash_rng.uniform(seeds.reshape(-1).long(), positions.long(), purpose)
    shape = positions.shape
    s = seeds.reshape((-1,) + (1,) * (len(shape) - 1)).to(torch.int64)
    h = _mix32(s & _M32)
    h = _mix32(h ^ ((s >> 32) & _M32))
    h = _mix32(h ^ (positions.to(torch.int64) & _M32))
    h = _mix32(h ^ (purpose * 0x9E3779B1 & _M32))
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def sample_from_probs(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling. probs: [N, V] (need not be normalised); u: [N] in (0, 1) -> [N] long.

    A token with zero probability is never chosen: it shares its CDF value with its predecessor
    and searchsorted returns the first index whose CDF reaches u * total.
    """
    cdf = probs.float().cumsum(dim=-1)  # [N, V]
    target = (u.float() * cdf[:, -1])[:, None]  # [N, 1]
    idx = torch.searchsorted(cdf, target).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)


def seed_tensor(seed: int | None, *, device: torch.device | str) -> torch.Tensor:
    """[1] int64 seed; an unseeded request draws one from torch's global generator."""
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    return torch.tensor([seed & ((1 << 63) - 1)], dtype=torch.int64, device=device)
