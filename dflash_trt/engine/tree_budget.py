# SPDX-License-Identifier: Apache-2.0
"""Which DDTree budget a round verifies: a pinned number of nodes, or one chosen by cost ("auto").

"auto" runs, per engine step, the candidate budget (0 = linear DFlash) with the most expected output
tokens per second, by the rule and measurements of engine/round_policy.py: a bigger tree accepts more
and costs more to verify, so at batch 1 a tree wins and at large batch the choice backs off to smaller
trees or the chain.

What a round measures. A tree round also tells tau for every smaller candidate budget: the best-first
tree of b nodes is the first b nodes of the bigger one, and the walk follows the target's choices,
which do not depend on the rest of the tree, so the accepted path under budget b is the path's
prefix of nodes numbered <= b. The chain's tau comes from linear rounds only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dflash_trt.engine.round_policy import EXPLORE_ROUNDS, CostPolicy, batch_bucket
from dflash_trt.errors import ConfigError

__all__ = ["AUTO_BUDGETS", "EXPLORE_ROUNDS", "BudgetPolicy", "batch_bucket"]

# "auto" chooses among these (0 = linear DFlash). A tree of N nodes verifies N + 1 rows with its root: 16,
# 32 and 64, whole 16-row tiles of the CPU GEMMs (and of GPU tensor-core tiles), like the 16-token chain.
# One row more costs a tile more: on `tiny` at batch 1 a compiled 15-node tree round is 1.06x a linear
# round, a 16-node one 1.15x, for tau 5.04 against 5.10 (bench/README.md, "Trees from one C++ operator").
AUTO_BUDGETS = (0, 15, 31, 63)


@dataclass
class BudgetPolicy(CostPolicy):
    """The budget per step: `pinned` (a fixed number of nodes; 0 = linear) or chosen by cost among
    `candidates`. Feed it every round with `record`."""

    candidates: tuple[int, ...] = AUTO_BUDGETS

    @classmethod
    def from_config(
        cls, tree_budget: int | str | None, *, candidates: tuple[int, ...] = AUTO_BUDGETS
    ) -> BudgetPolicy:
        """tree_budget as `DFlashDecodingConfig` holds it: 0/None (linear), a number, or "auto"."""
        if tree_budget in (None, 0):
            return cls(pinned=0)
        if isinstance(tree_budget, int) and not isinstance(tree_budget, bool):
            return cls(pinned=tree_budget, last=tree_budget)
        if tree_budget == "auto":
            return cls(candidates=tuple(sorted(set(candidates))))
        raise ConfigError(
            "speculative_config.tree_budget", tree_budget, "must be a number of nodes or 'auto'"
        )

    @property
    def max_budget(self) -> int:
        """The largest budget a round may verify (the scheduler reserves its scratch columns)."""
        return self.pinned if self.pinned is not None else max(self.candidates)

    def budgets(self) -> tuple[int, ...]:
        """Every budget a round may run (what a warm-up should compile)."""
        return (self.pinned,) if self.pinned is not None else self.candidates

    def record(self, budget: int, batch_size: int, seconds: float, accepted: Sequence[int],
               paths: Sequence[Sequence[int]]) -> None:  # fmt: skip
        """One round's measurements: its budget, batch size, wall seconds, and per request the drafts
        accepted and the accepted path's node index at each depth (root first; see RoundOutput)."""
        if not self._measures(batch_size):
            return
        self._record_cost(budget, batch_size, seconds)
        if budget == 0:
            self._add_tau(0, [a + 1 for a in accepted])
            return
        for b in self.candidates:
            if 0 < b <= budget:  # the path's prefix of nodes numbered <= b: the walk in b's tree
                tokens = [
                    1 + sum(1 for node in path[1 : a + 1] if node <= b) for a, path in zip(accepted, paths)
                ]
                self._add_tau(b, tokens)

    def summary(self) -> dict[str, object]:
        """The latest budget and the measured tau per budget (engine stats; the Triton model exports the
        budget as dflash_tree_budget)."""
        return {
            "tree_budget": self.last,
            "tree_budget_auto": self.auto,
            "tree_tau": {b: self.tau(b) for b in self.budgets() if self.tau(b) is not None},
        }
