# SPDX-License-Identifier: Apache-2.0
"""LLM-API outputs with TensorRT-LLM's shapes: RequestOutput, CompletionOutput and perf metrics."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field, replace


@dataclass
class SpeculativeDecodingMetrics:
    acceptance_rate: float  # accepted drafts / proposed drafts
    total_accepted_draft_tokens: int
    total_draft_tokens: int
    # dflash-trt additions
    acceptance_lengths: list[int] = field(default_factory=list)  # per round, bonus included
    mean_acceptance_length: float = 0.0  # tau: mean round length (0.0 before the first round)
    num_rounds: int = 0
    # DFlash 2: drafts whose selector pick is not the drafter's argmax (0 for v1 drafters); / total_draft_tokens
    # is the overturn rate
    total_overturned_draft_tokens: int = 0
    tree_budgets: list[int] | None = None  # DDTree engines: each round's budget (0 = linear); else None


@dataclass(slots=True)
class Logprob:
    """A token's log-probability and its rank in the distribution (1 = the most likely), TensorRT-LLM's
    shape. The distribution is the target's after penalties and bias, before temperature, top-k and
    top-p (docs/llm-api.md)."""

    logprob: float
    rank: int | None = None


@dataclass
class TimingMetrics:
    """Offsets on the engine's monotonic clock (datetime.timedelta, like TensorRT-LLM)."""

    arrival_time: datetime.timedelta
    first_scheduled_time: datetime.timedelta | None
    first_token_time: datetime.timedelta | None
    last_token_time: datetime.timedelta | None


@dataclass
class KvCacheMetrics:
    """TensorRT-LLM's per-request KV-cache figures, in pages (blocks): the prompt's full pages found in
    the prefix cache (reused) or not (missed), the pages the request allocated and holds in all."""

    num_total_allocated_blocks: int = 0
    num_new_allocated_blocks: int = 0
    num_reused_blocks: int = 0
    num_missed_blocks: int = 0
    kv_cache_hit_rate: float = 0.0


@dataclass
class RequestPerfMetrics:
    timing_metrics: TimingMetrics
    speculative_decoding: SpeculativeDecodingMetrics
    kv_cache_metrics: KvCacheMetrics | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    stop_reason: int | str | None = None
    text_diff: str = ""  # new text since the previous streamed output of this request
    token_ids_diff: list[int] = field(default_factory=list)
    request_perf_metrics: RequestPerfMetrics | None = None
    # with SamplingParams.logprobs = k: per output token, {token: Logprob} for the token itself and the k
    # most likely ones; cumulative_logprob is the sum over the output tokens (None without logprobs)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    # with SamplingParams.prompt_logprobs = k: per prompt token, as `logprobs` (None for the first, which
    # nothing predicts)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def length(self) -> int:
        return len(self.token_ids)


@dataclass
class RequestOutput:
    """One snapshot of a request (TensorRT-LLM's RequestOutput / GenerationResult shape)."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (vLLM's name)


def best_of(outputs: list[CompletionOutput], n: int) -> list[CompletionOutput]:
    """The n sequences with the highest cumulative log-probability, best first, indexed 0..n-1 in that
    order (best_of's rule, as vLLM and TensorRT-LLM apply it)."""
    ranked = sorted(
        outputs, key=lambda c: -(c.cumulative_logprob if c.cumulative_logprob is not None else 0.0)
    )
    return [replace(c, index=i) for i, c in enumerate(ranked[:n])]


def merged(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """`newer` as one streamed output that also carries `older`'s news: the snapshot fields (text, ids,
    finish, metrics) are newer's, the diffs are older's followed by newer's. A consumer that fell behind
    gets the outputs it has not read as one (GenerationHandle's async iteration)."""
    comps = [
        replace(n, text_diff=o.text_diff + n.text_diff, token_ids_diff=o.token_ids_diff + n.token_ids_diff)
        for o, n in zip(older.outputs, newer.outputs)
    ]
    return replace(newer, outputs=comps + list(newer.outputs[len(comps) :]))
