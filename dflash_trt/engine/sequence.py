# SPDX-License-Identifier: Apache-2.0
"""Per-request state inside the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any


class Status(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
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
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    slot: int = -1  # row in the runner's per-sequence buffers
    prefilled: int = 0  # prompt tokens already in the caches
    pending: int = 0  # rows of pending draft context (committed, not yet injected)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    # speculative statistics
    acceptance_lengths: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
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
    def finished(self) -> bool:
        return self.status is Status.FINISHED
