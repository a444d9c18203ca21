# SPDX-License-Identifier: Apache-2.0
"""A request inside the engine: its parameters as the engine sees them, and its running state."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

# max_tokens when a request does not say: TensorRT-LLM's SamplingParams default, shared by the LLM
# API and the Triton model (the OpenAI front has its own protocol defaults: docs/serving.md).
DEFAULT_MAX_TOKENS = 32
# guided decoding's guide types (TensorRT-LLM's, and ours structural_tag): RequestParams.guide's first item
GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar", "structural_tag")


class Status(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestParams:
    """Per-request parameters in the engine's terms (the LLM API maps SamplingParams onto these).
    `LLMEngine.add_request` validates every field."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()  # besides the end ids
    ignore_eos: bool = False  # do not stop at the end ids
    end_id: int | None = None  # the end id; None = the model's eos ids
    stop: tuple[str, ...] = ()
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    greedy_draft: bool = False
    skip_special_tokens: bool = True
    # what a request may do to the target's distribution (spec/penalties.py); the defaults are off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    min_p: float = 0.0
    logprobs: int | None = None  # report each token's log-probability and this many alternatives
    n: int = 1  # sequences sampled from the prompt: one prefill, then n independent decodes
    prompt_logprobs: int | None = None  # score the prompt: its tokens' log-probabilities (k alternatives)
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences never generated (spec/penalties.py)
    guide: tuple[str, str] | None = None  # guided decoding: (guide type, text) (engine/grammar.py)


@dataclass
class Request:
    request_id: int
    prompt_ids: list[int]
    max_len: int  # prompt + max_tokens: generation stops when start + 1 reaches it
    temperature: float
    top_k: int
    top_p: float
    seed: int
    greedy_draft: bool
    stop_token_ids: frozenset[int]
    stop_strings: tuple[str, ...]
    min_tokens: int
    include_stop_str_in_output: bool
    detokenizer: Any | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    bad_words: tuple[tuple[int, ...], ...] = ()
    guide: Any = None  # guided decoding: the sequence's matcher (engine/grammar.py Guide)
    # sampled with the caller's seed: its tokens must not depend on what it is batched with, so its
    # rounds draft the full block (a draft length chosen by load would change its samples)
    reproducible: bool = False
    owner: Any = None  # opaque to the engine: whoever submitted the request (the LLM's handle)
    # n > 1: the group's sequence index; the leader (index 0) prefills the prompt once and holds the
    # other sequences, which copy its caches when its prefill ends (`siblings`, emptied then)
    index: int = 0
    siblings: list[Request] = field(default_factory=list)
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    row: int = -1  # this request's row in the runner's per-request buffers while it holds one
    prefilled: int = 0  # prompt tokens already in the caches
    cached_tokens: int = 0  # of them, found in the prefix cache (not prefilled by this request)
    reserved_pages: int = 0  # the pages it was admitted with (kept for its metrics after it ends)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # speculative statistics
    acceptance_lengths: list[int] = field(default_factory=list)
    tree_budgets: list[int] = field(default_factory=list)  # DDTree engines: each round's budget (0 = linear)
    # with logprobs: per output token, (its log-probability, its rank, the most likely tokens with theirs)
    token_logprobs: list[Any] = field(default_factory=list)
    # with prompt_logprobs: per prompt token after the first, as token_logprobs (raw: before penalties)
    prompt_token_logprobs: list[Any] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_overturned_draft_tokens: int = 0  # DFlash 2: drafts the selector picked over the drafter's argmax
    # timing (perf_counter seconds)
    arrival_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    text: str = ""

    @property
    def start(self) -> int:
        """Absolute position of the anchor (the last emitted token) = tokens in the target cache."""
        return len(self.prompt_ids) + len(self.output_ids) - 1

    @property
    def last_token(self) -> int:
        return self.output_ids[-1]

    @property
    def needs_filter(self) -> bool:
        return self.temperature > 0 and (self.top_k > 0 or self.top_p < 1.0)

    @property
    def processed(self) -> bool:
        """Whether a penalty, a logit bias, a bad word or min-p changes this request's distribution."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.bad_words or (self.min_p and self.temperature > 0))  # fmt: skip

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def group(self) -> list[Request]:
        """This request and the sequences still waiting for its prefill (n > 1; cancelled ones left out)."""
        return [self, *(s for s in self.siblings if not s.finished)]
