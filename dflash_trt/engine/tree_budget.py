# SPDX-License-Identifier: Apache-2.0
"""Which DDTree budget a round verifies: a pinned number of nodes, or one chosen by cost ("auto").

The rule for "auto", per engine step with n running requests: run the candidate budget b (0 = linear
DFlash) with the most expected output tokens per second,

    rate(b, n) = n * tau(b) / round_s(b, n)

  tau(b)        tokens a request gets from one round at budget b (accepted drafts + 1), measured;
  round_s(b, n) wall time of one engine round at budget b for a batch of about n requests, measured
                per batch bucket (the power of two at or above n).

A bigger tree accepts more (tau grows with b) and costs more to verify (round_s grows with b * n):
at batch 1 a round is mostly fixed per-operator cost and a tree wins; at large batch the verify pass
is compute-bound and the rule backs off to smaller trees or the chain.

Measurements. Both are moving averages of the engine's own rounds, so the choice follows the machine
and the workload. A tree round also tells tau for every smaller candidate budget: the best-first
tree of b nodes is the first b nodes of the bigger one, and the walk follows the target's choices,
which do not depend on the rest of the tree, so the accepted path under budget b is the path's
prefix of nodes numbered <= b. The chain's tau comes from linear rounds only.

Round costs are kept relative to the bucket's reference budget, the one in use (its own average in
seconds is refreshed every round it runs): another budget's cost is the average of its rounds'
seconds over the reference's average at the time. A machine whose load changes slows both alike, so
the ratios stay right where absolute averages taken minutes apart would not; when the choice moves
to another budget, that budget becomes the reference (the ratios are rebased).

Exploration, deterministic: in a new bucket every candidate runs EXPLORE_ROUNDS measured rounds
before any is exploited, the candidates taking turns (the one with the fewest rounds first, the
largest budget on a tie: its rounds measure tau for the smaller ones too), so that a machine whose
load drifts slows them alike; a budget's very first round is not measured (it may allocate or
compile). Afterwards every `explore_every`-th step of a bucket re-measures another candidate: mostly
a neighbour of the best budget (the next smaller and the next larger, in turn), since more nodes
accept more but cost more, so the rate rises then falls with the budget and a better budget shows
first next to the best one; every third time one of the others, in turn, so that a plateau (two
budgets accepting alike) does not hide a better one further off. Ties go to the smaller budget.
No clock is read here: the engine passes the measured seconds in (tests pass their own).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from dflash_trt.errors import ConfigError

AUTO_BUDGETS = (0, 16, 32, 64)  # "auto" chooses among these (0 = linear DFlash)
TAU_HALF_LIFE = 64  # request-rounds after which a tau measurement weighs half
COST_SMOOTHING = 0.25  # weight of the newest round in the cost average
EXPLORE_ROUNDS = 1  # measured rounds of every candidate in a new bucket before the choice is made
EXPLORE_EVERY = 32  # steps of a bucket between two later exploration rounds (a neighbour of the best)


def batch_bucket(n: int) -> int:
    """The power of two at or above n (round costs are kept per bucket)."""
    return 1 << max(0, (n - 1).bit_length())


@dataclass
class _Tau:
    """Tokens per request-round, averaged with a half-life counted in request-rounds."""

    tokens: float = 0.0
    rounds: float = 0.0

    def add(self, tokens: Sequence[int]) -> None:
        keep = 0.5 ** (len(tokens) / TAU_HALF_LIFE)
        self.tokens = keep * self.tokens + sum(tokens)
        self.rounds = keep * self.rounds + len(tokens)

    @property
    def value(self) -> float | None:
        return self.tokens / self.rounds if self.rounds else None


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - COST_SMOOTHING) * old + COST_SMOOTHING * new


@dataclass
class _Bucket:
    """One batch bucket's round costs: the reference budget's seconds per round, the others' relative
    to it (see the module docstring), rounds seen per budget, and the exploration schedule."""

    ref: int | None = None  # the reference budget (the one in use)
    ref_s: float | None = None  # its seconds per round, averaged
    rel: dict[int, float] = field(default_factory=dict)  # other budgets: seconds per round / ref_s
    seen: dict[int, int] = field(default_factory=dict)  # rounds run per budget
    measured: dict[int, int] = field(default_factory=dict)  # rounds measured per budget
    steps: int = 0  # choices made in this bucket
    turn: int = 0  # the next exploration neighbour

    def add(self, budget: int, seconds: float, *, measure: bool) -> None:
        self.seen[budget] = self.seen.get(budget, 0) + 1
        if not measure:
            return
        self.measured[budget] = self.measured.get(budget, 0) + 1
        if self.ref is None or self.ref_s is None:
            self.ref, self.ref_s = budget, seconds
        elif budget == self.ref:
            self.ref_s = _average(self.ref_s, seconds)
        else:
            self.rel[budget] = _average(self.rel.get(budget), seconds / self.ref_s)

    def seconds(self, budget: int) -> float | None:
        if self.ref_s is None or (budget != self.ref and budget not in self.rel):
            return None
        return self.ref_s if budget == self.ref else self.rel[budget] * self.ref_s

    def rebase(self, budget: int) -> None:
        """Make `budget` (measured) the reference."""
        if budget == self.ref or budget not in self.rel or self.ref is None or self.ref_s is None:
            return
        r = self.rel.pop(budget)
        self.rel = {b: v / r for b, v in self.rel.items()}
        self.rel[self.ref] = 1 / r
        self.ref, self.ref_s = budget, self.ref_s * r


@dataclass
class BudgetPolicy:
    """The budget per step: `pinned` (a fixed number of nodes; 0 = linear) or chosen by cost among
    `candidates`. Feed it every round with `record`."""

    candidates: tuple[int, ...] = AUTO_BUDGETS
    pinned: int | None = None
    explore_every: int = EXPLORE_EVERY
    last: int = 0  # the budget of the latest round
    override: int | None = None  # while set, every round runs this budget (the engine's warm-up)
    _tau: dict[int, _Tau] = field(default_factory=dict)
    _buckets: dict[int, _Bucket] = field(default_factory=dict)
    _ran: set[int] = field(default_factory=set)  # budgets that ran at least one round

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

    @property
    def auto(self) -> bool:
        return self.pinned is None

    def budgets(self) -> tuple[int, ...]:
        """Every budget a round may run (what a warm-up should compile)."""
        return (self.pinned,) if self.pinned is not None else self.candidates

    def tau(self, budget: int) -> float | None:
        return self._tau[budget].value if budget in self._tau else None

    def round_seconds(self, budget: int, batch_size: int) -> float | None:
        """The expected seconds of a round at this budget and batch (None until measured)."""
        bucket = self._buckets.get(batch_bucket(batch_size))
        return bucket.seconds(budget) if bucket is not None else None

    def rate(self, budget: int, batch_size: int) -> float | None:
        """Expected output tokens per second at this budget and batch (None until measured)."""
        tau, seconds = self.tau(budget), self.round_seconds(budget, batch_size)
        if tau is None or seconds is None or seconds <= 0:
            return None
        return batch_size * tau / seconds

    def choose(self, batch_size: int) -> int:
        """The budget for the next round of `batch_size` requests."""
        fixed = self.override if self.override is not None else self.pinned
        if fixed is not None:
            self.last = fixed
            return fixed
        bucket = self._buckets.setdefault(batch_bucket(batch_size), _Bucket())
        step = bucket.steps
        bucket.steps += 1
        unexplored = [
            b
            for b in self.candidates
            if bucket.measured.get(b, 0) < EXPLORE_ROUNDS or self.rate(b, batch_size) is None
        ]
        if unexplored:
            # in turn: the fewest rounds first, the biggest tree on a tie (it measures the smaller trees' tau)
            self.last = min(unexplored, key=lambda b: (bucket.seen.get(b, 0), -b))
            return self.last
        best = self.best(batch_size)
        bucket.rebase(best)  # the budget in use is the one the others are measured against
        if step % self.explore_every == self.explore_every - 1 and len(self.candidates) > 1:
            self.last = self._explore(bucket, best)
            return self.last
        self.last = best
        return best

    def _explore(self, bucket: _Bucket, best: int) -> int:
        """The candidate an exploration step re-measures: two turns in three a neighbour of `best`,
        the third one of the farther candidates (each list taken in turn)."""
        i = self.candidates.index(best)
        near = self.candidates[max(0, i - 1) : i] + self.candidates[i + 1 : i + 2]
        far = [b for b in self.candidates if b != best and b not in near]
        turn = bucket.turn
        bucket.turn += 1
        if far and turn % 3 == 2:
            return far[(turn // 3) % len(far)]
        return near[(turn - turn // 3) % len(near)]

    def best(self, batch_size: int) -> int:
        """The candidate with the highest measured rate (ties: the smaller budget)."""
        rates = {b: self.rate(b, batch_size) or 0.0 for b in self.candidates}
        return max(self.candidates, key=lambda b: (rates[b], -b))

    def record(self, budget: int, batch_size: int, seconds: float, accepted: Sequence[int],
               paths: Sequence[Sequence[int]]) -> None:  # fmt: skip
        """One round's measurements: its budget, batch size, wall seconds, and per request the drafts
        accepted and the accepted path's node index at each depth (root first; see RoundOutput)."""
        if self.pinned is not None or self.override is not None:
            return
        bucket = self._buckets.setdefault(batch_bucket(batch_size), _Bucket())
        bucket.add(budget, seconds, measure=budget in self._ran)  # a first round may allocate or compile
        self._ran.add(budget)
        if budget == 0:
            self._tau.setdefault(0, _Tau()).add([a + 1 for a in accepted])
            return
        for b in self.candidates:
            if 0 < b <= budget:  # the path's prefix of nodes numbered <= b: the walk in b's tree
                tokens = [
                    1 + sum(1 for node in path[1 : a + 1] if node <= b) for a, path in zip(accepted, paths)
                ]
                self._tau.setdefault(b, _Tau()).add(tokens)

    def reset(self) -> None:
        """Forget every measurement (after a warm-up, whose rounds compile)."""
        self._tau.clear()
        self._buckets.clear()
        self._ran.clear()

    def summary(self) -> dict[str, object]:
        """The latest budget and the measured tau per budget (engine stats; the Triton model exports the
        budget as dflash_tree_budget)."""
        return {
            "tree_budget": self.last,
            "tree_budget_auto": self.auto,
            "tree_tau": {b: self.tau(b) for b in self.budgets() if self.tau(b) is not None},
        }
