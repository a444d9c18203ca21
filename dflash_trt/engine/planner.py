# SPDX-License-Identifier: Apache-2.0
"""The round's shape, decided in one place: how many tokens a round drafts and whether it verifies a
DDTree of how many nodes.

`RoundPlanner.plan(requests)` gives the next round's `RoundShape` (draft length g, tree budget, the
batch's sampling flags); `record(shape, n, seconds, out)` feeds back what the round cost and accepted;
`shapes(n)` lists every (g, budget) a round of n requests may run (what the warm-up compiles);
`pin(g, budget)` makes every round run one shape (the warm-up's throwaway batches). Without a drafter
the engine holds a `NullPlanner`: every round is plain decoding.

Two cost policies do the choosing (engine/round_policy.py): the draft length (engine/draft_len.py,
linear DFlash, and the chain a DDTree engine with budget "auto" compares its trees with) and the tree
budget (engine/tree_budget.py). A tree spans the full block, so with trees on only the full block's
rounds verify one; a shorter chain is the draft-length policy's. A round with a seeded sampled request
drafts the full block unless a schedule or the warm-up says otherwise: its samples then never depend
on the load (docs/llm-api.md). A user's `draft_len_schedule` pins g per batch size, a number pins the
tree budget.

What the scheduler needs from the plan is here too: the most cache columns one round writes past a
request's anchor (`round_tokens`) and the scratch a tree needs past max_len (`scratch_tokens`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dflash_trt.engine.draft_len import DraftLenPolicy
from dflash_trt.engine.round import RoundShape, round_flags
from dflash_trt.engine.tree_budget import BudgetPolicy

if TYPE_CHECKING:
    from dflash_trt.engine.request import Request
    from dflash_trt.engine.round import RoundOutput


class NullPlanner:
    """Plain decoding: no drafter, every round emits one token per request."""

    trees = False
    draft_lens: DraftLenPolicy | None = None  # the draft-length policy (RoundPlanner's; none here)
    max_draft_len = 0
    scratch_tokens = 0
    round_tokens = 1

    def plan(self, reqs: list[Request]) -> RoundShape:
        return RoundShape(0, 0, round_flags(reqs))

    def record(self, shape: RoundShape, batch_size: int, seconds: float, out: RoundOutput) -> None:
        pass

    def shapes(self, batch_size: int) -> list[tuple[int, int]]:
        return [(0, 0)]

    def pin(self, g: int, budget: int) -> None:
        pass

    def unpin(self) -> None:
        pass

    def reset(self) -> None:
        pass

    def describe(self) -> str:
        return "plain decoding"

    def summary(self) -> dict[str, Any]:
        return {}


class RoundPlanner(NullPlanner):
    """DFlash rounds: the draft length and the tree budget per step, pinned or chosen by cost."""

    def __init__(
        self,
        max_draft_len: int,
        *,
        tree_budget: int | str | None = 0,
        schedule: Callable[[int], int] | None = None,
    ) -> None:
        """max_draft_len: K, the drafter's block - 1; tree_budget as `DFlashDecodingConfig` holds it
        (0, a number of nodes, or "auto"); schedule: the user's batch size -> draft length
        (`draft_len_schedule` / `max_concurrency`), None for the choice by cost."""
        self.max_draft_len = max_draft_len
        self.budgets = BudgetPolicy.from_config(tree_budget)
        self.trees = self.budgets.max_budget > 0
        self._schedule = schedule
        # the draft length by cost or schedule: linear DFlash, and the chain of a DDTree engine whose
        # budget is "auto" (a busy batch then drafts a short chain, as a linear engine does, instead of
        # the full block's chain or tree); a pinned budget keeps the block (or the user's schedule)
        self.draft_lens: DraftLenPolicy | None = None
        if not self.trees or self.budgets.auto:
            self.draft_lens = DraftLenPolicy.for_spec(max_draft_len, schedule)
        self.scratch_tokens = self.budgets.max_budget
        self.round_tokens = max(max_draft_len + 1, self.scratch_tokens + 1 if self.trees else 0)

    def plan(self, reqs: list[Request]) -> RoundShape:
        n, flags = len(reqs), round_flags(reqs)
        g = self._draft_len(n, reproducible=any(r.reproducible for r in reqs))
        # a batch with penalties or log-probabilities verifies the chain: a tree's nodes would each need
        # their path's counts, and the logits are per node, not per committed position
        budget = self.budgets.choose(n) if self._tree_round(g) and not (flags[3] or flags[4]) else 0
        return RoundShape(g, budget, flags)

    def record(self, shape: RoundShape, batch_size: int, seconds: float, out: RoundOutput) -> None:
        if self._tree_round(shape.g):
            self.budgets.record(shape.budget, batch_size, seconds, out.accepted, out.path)
        if self.draft_lens is not None:
            self.draft_lens.record(shape.g, batch_size, seconds, out.accepted)

    def shapes(self, batch_size: int) -> list[tuple[int, int]]:
        """Every (g, budget) a round of `batch_size` requests may run, the longest draft first."""
        if self.draft_lens is not None:
            lens = sorted(self.draft_lens.draft_lens(batch_size), reverse=True)
        else:
            lens = [self._by_schedule(batch_size)]
        return [
            (g, b if g > 0 else 0)
            for g in lens
            for b in (self.budgets.budgets() if self._tree_round(g) else (0,))
        ]

    def pin(self, g: int, budget: int) -> None:
        self.budgets.override = budget
        if self.draft_lens is not None:
            self.draft_lens.override = g

    def unpin(self) -> None:
        self.budgets.override = None
        if self.draft_lens is not None:
            self.draft_lens.override = None

    def reset(self) -> None:
        """Forget every measured cost (after the warm-up, whose rounds compile, or once compiled rounds
        replace eager ones: the costs measured before no longer hold)."""
        self.budgets.reset()
        if self.draft_lens is not None:
            self.draft_lens.reset()

    def describe(self) -> str:
        lens = "auto" if self.draft_lens is not None and self.draft_lens.auto else "by schedule"
        budget = "auto" if self.budgets.auto else self.budgets.pinned
        return f"draft length {lens}, tree budget {budget}"

    def summary(self) -> dict[str, Any]:
        return {
            **(self.budgets.summary() if self.trees else {}),
            **(self.draft_lens.summary() if self.draft_lens is not None else {}),
        }

    def _tree_round(self, g: int) -> bool:
        """Whether a round drafting `g` tokens may verify a DDTree (with trees on: the full block's)."""
        if not self.trees:
            return g > 0
        return g > 0 and g == self.max_draft_len

    def _draft_len(self, batch_size: int, *, reproducible: bool) -> int:
        if self.draft_lens is not None:
            return self.draft_lens.choose(batch_size, keep_block=reproducible)
        return self._by_schedule(batch_size)

    def _by_schedule(self, batch_size: int) -> int:
        """A pinned tree budget's draft length: the user's schedule, else the full block."""
        return int(self._schedule(batch_size)) if self._schedule is not None else self.max_draft_len
