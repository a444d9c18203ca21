# SPDX-License-Identifier: Apache-2.0
"""How many tokens a linear DFlash round drafts: the user's schedule, or chosen by cost (the default).

With neither `draft_len_schedule` nor `max_concurrency` in the speculative config, the engine picks the
draft length g per step among `auto_draft_lens(K)`: K, (K + 1) / 2 - 1, (K + 1) / 4 - 1 and 0 (plain
decoding) by the rule of engine/round_policy.py: the most expected output tokens per second for the
batch, at every batch size. On `tiny` a round at batch 1 is mostly fixed per-operator cost, the
verify pass of K + 1 tokens costs about what one token's does, and the full block wins. On a real
vocabulary it does not always: `smollm2-135m`'s verify of 16 tokens multiplies a 49152-row LM head
and costs about two plain steps at batch 1, so a drafter that accepts little loses to plain decoding
even alone (bench/README.md). At large batch the verify pass is compute-bound on a CPU (a block of 16
at batch 16 made `tiny` slower than plain decoding), so the choice backs off to shorter blocks or none.

What a round measures: the tau of its own draft length only (a shorter block is drafted by a pass
of its own, whose drafts may differ from the longer block's first ones). Plain decoding's tau is 1.
A schedule (`draft_len_schedule`, or `max_concurrency` N = {N: K}) pins the draft length per batch
size, as TensorRT-LLM's does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dflash_trt.engine.round_policy import CostPolicy


def auto_draft_lens(max_draft_len: int) -> tuple[int, ...]:
    """The draft lengths "auto" chooses among (ascending): K, about K/2 and K/4 (blocks of half and a
    quarter of the trained block), and 0."""
    block = max_draft_len + 1
    lens = {max_draft_len, 0} | {block // d - 1 for d in (2, 4) if block // d - 1 >= 2}
    return tuple(sorted(lens))


@dataclass
class DraftLenPolicy(CostPolicy):
    """The draft length per step: from `schedule` (batch size -> g; None = chosen by cost among
    `candidates`). Feed it every round with `record`."""

    max_draft_len: int = 0
    schedule: Callable[[int], int] | None = None  # the user's draft_len_schedule lookup
    rounds: dict[int, int] = field(default_factory=dict)  # rounds run per draft length (never reset)

    @classmethod
    def for_spec(cls, max_draft_len: int, schedule: Callable[[int], int] | None = None) -> DraftLenPolicy:
        """K = max_draft_len; schedule: a function batch size -> draft length (the user's
        `draft_len_schedule` / `max_concurrency`), or None for the choice by cost."""
        return cls(candidates=auto_draft_lens(max_draft_len), max_draft_len=max_draft_len,
                   schedule=schedule, last=max_draft_len, monotone_cost=True)  # fmt: skip

    def tau(self, candidate: int) -> float | None:
        return 1.0 if candidate == 0 else super().tau(candidate)  # plain decoding: one token a round

    @property
    def auto(self) -> bool:
        return self.schedule is None

    def fixed(self, batch_size: int) -> int | None:
        if self.schedule is not None:
            return int(self.schedule(batch_size))
        return self.override

    def choose(self, batch_size: int, *, keep_block: bool = False) -> int:
        """The draft length for the next round; keep_block: the full block K unless fixed otherwise
        (a batch with a seeded sampled request, whose samples must not depend on the load)."""
        if keep_block and self.fixed(batch_size) is None:
            self.last = self.max_draft_len
            return self.max_draft_len
        return super().choose(batch_size)

    def draft_lens(self, batch_size: int) -> tuple[int, ...]:
        """Every draft length a round of `batch_size` requests may run (what a warm-up compiles)."""
        fixed = self.fixed(batch_size)
        return (fixed,) if fixed is not None else self.candidates

    def record(self, draft_len: int, batch_size: int, seconds: float, accepted: Sequence[int]) -> None:
        """One round's measurements: its draft length, batch size, wall seconds and the drafts each
        request accepted."""
        self.rounds[draft_len] = self.rounds.get(draft_len, 0) + 1
        if not self._measures(batch_size):
            return
        self._record_cost(draft_len, batch_size, seconds)
        if draft_len > 0:
            self._add_tau(draft_len, [a + 1 for a in accepted])

    def summary(self) -> dict[str, object]:
        """The latest draft length and the measured tau per draft length (engine stats; the Triton
        model exports the draft length as dflash_draft_len)."""
        return {
            "draft_len": self.last,
            "draft_len_auto": self.auto,
            "draft_len_tau": {g: self.tau(g) for g in self.candidates if g > 0 and self.tau(g) is not None},
            "draft_len_rounds": dict(sorted(self.rounds.items())),
        }
