# SPDX-License-Identifier: Apache-2.0
"""Choosing a round's kind by measured cost: the machinery the DDTree budget (engine/tree_budget.py)
and the draft length (engine/draft_len.py) share.

A policy holds candidates (sortable: a bigger candidate drafts or verifies more per round) and, per
engine step with n running requests, runs the candidate c with the most expected output tokens per
second,

    rate(c, n) = n * tau(c) / round_s(c, n)

  tau(c)        tokens a request gets from one round of kind c (accepted drafts + 1), measured;
  round_s(c, n) wall time of one engine round of kind c for a batch of about n requests, measured
                per batch bucket (the power of two at or above n).

A bigger candidate accepts more (tau grows) and costs more (round_s grows with the tokens verified):
at batch 1 a round is mostly fixed per-operator cost and the biggest candidate wins; at large batch
the verify pass is compute-bound and the choice backs off.

Measurements. Both are moving averages of the engine's own rounds, so the choice follows the machine
and the workload. Which candidates' tau one round measures is the subclass's rule (`record`).

Round costs are kept relative to the bucket's reference candidate, the one in use (its own average in
seconds is refreshed every round it runs): another candidate's cost is the average of its rounds'
seconds over the reference's average at the time. A machine whose load changes slows both alike, so
the ratios stay right where absolute averages taken minutes apart would not; when the choice moves
to another candidate, that one becomes the reference (the ratios are rebased).

Exploration, deterministic: in a new bucket every candidate runs EXPLORE_ROUNDS measured rounds before
any is exploited, the candidates taking turns (the one with the fewest rounds first, the biggest on a
tie: a big DDTree's rounds measure the smaller trees' tau too), so that a machine whose load drifts
slows them alike; a candidate's first round in a bucket is not measured (it may allocate or compile:
batch 1 has compiled rounds of its own). Afterwards every `explore_every`-th step of a bucket re-
measures another candidate: mostly a neighbour of the best (the next smaller and the next larger, in
turn), since the rate rises then falls with the candidate's size and a better one shows first next to
the best; every third time one of the others, in turn, so that a plateau (two candidates accepting
alike) does not hide a better one further off. Where a round's cost grows with its candidate
(`monotone_cost`: the draft length), a new bucket explores one candidate after the other, the smallest
first, and skips one whose tau, known from other buckets, cannot beat the best rate measured here even
at the least cost it could have (that of the dearest smaller candidate measured here); the periodic re-
measurement still visits it. Ties go to the smaller candidate. No clock is read here: the engine passes
the measured seconds in (tests pass their own).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

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
    """One batch bucket's round costs: the reference candidate's seconds per round, the others'
    relative to it (see the module docstring), rounds seen per candidate, and the exploration schedule."""

    ref: int | None = None  # the reference candidate (the one in use)
    ref_s: float | None = None  # its seconds per round, averaged
    rel: dict[int, float] = field(default_factory=dict)  # other candidates: seconds per round / ref_s
    seen: dict[int, int] = field(default_factory=dict)  # rounds run per candidate
    measured: dict[int, int] = field(default_factory=dict)  # rounds measured per candidate
    steps: int = 0  # choices made in this bucket
    turn: int = 0  # the next exploration neighbour

    def add(self, candidate: int, seconds: float) -> None:
        first = candidate not in self.seen  # a first round in a bucket may allocate or compile
        self.seen[candidate] = self.seen.get(candidate, 0) + 1
        if first:
            return
        self.measured[candidate] = self.measured.get(candidate, 0) + 1
        if self.ref is None or self.ref_s is None:
            self.ref, self.ref_s = candidate, seconds
        elif candidate == self.ref:
            self.ref_s = _average(self.ref_s, seconds)
        else:
            self.rel[candidate] = _average(self.rel.get(candidate), seconds / self.ref_s)

    def seconds(self, candidate: int) -> float | None:
        if self.ref_s is None or (candidate != self.ref and candidate not in self.rel):
            return None
        return self.ref_s if candidate == self.ref else self.rel[candidate] * self.ref_s

    def rebase(self, candidate: int) -> None:
        """Make `candidate` (measured) the reference."""
        if candidate == self.ref or candidate not in self.rel or self.ref is None or self.ref_s is None:
            return
        r = self.rel.pop(candidate)
        self.rel = {b: v / r for b, v in self.rel.items()}
        self.rel[self.ref] = 1 / r
        self.ref, self.ref_s = candidate, self.ref_s * r


@dataclass
class CostPolicy:
    """The candidate per step: `pinned`, or chosen by cost among `candidates` (ascending). Subclasses
    say which candidates' tau a round measures (`record`) and may fix the choice for some batch
    sizes (`fixed`)."""

    candidates: tuple[int, ...] = (0,)
    pinned: int | None = None
    explore_every: int = EXPLORE_EVERY
    # costs grow with the candidate (a round drafting more tokens never costs less): a new bucket then
    # explores the smallest first and skips a candidate whose bound cannot beat the best (`_hopeless`)
    monotone_cost: bool = False
    last: int = 0  # the candidate of the latest round
    override: int | None = None  # while set, every round runs this candidate (the engine's warm-up)
    _tau: dict[int, _Tau] = field(default_factory=dict)
    _buckets: dict[int, _Bucket] = field(default_factory=dict)

    @property
    def auto(self) -> bool:
        return self.pinned is None

    def tau(self, candidate: int) -> float | None:
        return self._tau[candidate].value if candidate in self._tau else None

    def round_seconds(self, candidate: int, batch_size: int) -> float | None:
        """The expected seconds of a round of this candidate and batch (None until measured)."""
        bucket = self._buckets.get(batch_bucket(batch_size))
        return bucket.seconds(candidate) if bucket is not None else None

    def rate(self, candidate: int, batch_size: int) -> float | None:
        """Expected output tokens per second for this candidate and batch (None until measured)."""
        tau, seconds = self.tau(candidate), self.round_seconds(candidate, batch_size)
        if tau is None or seconds is None or seconds <= 0:
            return None
        return batch_size * tau / seconds

    def fixed(self, batch_size: int) -> int | None:
        """The candidate every round of this batch size runs, when it is not chosen by cost."""
        return self.override if self.override is not None else self.pinned

    def choose(self, batch_size: int) -> int:
        """The candidate for the next round of `batch_size` requests."""
        fixed = self.fixed(batch_size)
        if fixed is not None:
            self.last = fixed
            return fixed
        bucket = self._buckets.setdefault(batch_bucket(batch_size), _Bucket())
        step = bucket.steps
        bucket.steps += 1
        unexplored = [
            c
            for c in self.candidates
            if (bucket.measured.get(c, 0) < EXPLORE_ROUNDS or self.rate(c, batch_size) is None)
            and not self._hopeless(c, bucket, batch_size)
        ]
        if unexplored:
            # in turn: the fewest rounds first, the biggest candidate on a tie; with monotone costs one
            # after the other, the smallest first, so that the cheaper ones' costs can rule out the dearer
            turn = (lambda c: c) if self.monotone_cost else (lambda c: (bucket.seen.get(c, 0), -c))
            self.last = min(unexplored, key=turn)
            return self.last
        best = self.best(batch_size)
        bucket.rebase(best)  # the candidate in use is the one the others are measured against
        if step % self.explore_every == self.explore_every - 1 and len(self.candidates) > 1:
            self.last = self._explore(bucket, best)
            return self.last
        self.last = best
        return best

    def _hopeless(self, candidate: int, bucket: _Bucket, batch_size: int) -> bool:
        """With monotone costs: whether `candidate`, unmeasured in this bucket, cannot beat the best
        measured rate even at the cost of the dearest smaller candidate measured here (its least
        possible cost), given its tau (known from other buckets). Not explored then: on a CPU at large
        batch the full block's verify costs many plain steps, and a short burst of load is over before
        exploring it pays back."""
        tau = self.tau(candidate)
        if not self.monotone_cost or tau is None:
            return False
        measured = [c for c in self.candidates if bucket.measured.get(c, 0) >= EXPLORE_ROUNDS]
        floor = [s for c in measured if c < candidate and (s := bucket.seconds(c)) is not None]
        rates = [r for c in measured if (r := self.rate(c, batch_size)) is not None]
        return bool(floor and rates) and batch_size * tau / max(floor) < max(rates)

    def _explore(self, bucket: _Bucket, best: int) -> int:
        """The candidate an exploration step re-measures: two turns in three a neighbour of `best`,
        the third one of the farther candidates (each list taken in turn)."""
        i = self.candidates.index(best)
        near = self.candidates[max(0, i - 1) : i] + self.candidates[i + 1 : i + 2]
        far = [c for c in self.candidates if c != best and c not in near]
        turn = bucket.turn
        bucket.turn += 1
        if far and turn % 3 == 2:
            return far[(turn // 3) % len(far)]
        return near[(turn - turn // 3) % len(near)]

    def best(self, batch_size: int) -> int:
        """The candidate with the highest measured rate (ties: the smaller one)."""
        rates = {c: self.rate(c, batch_size) or 0.0 for c in self.candidates}
        return max(self.candidates, key=lambda c: (rates[c], -c))

    def _measures(self, batch_size: int) -> bool:
        """Whether rounds of this batch size are chosen by cost (and so recorded)."""
        return self.fixed(batch_size) is None

    def _record_cost(self, candidate: int, batch_size: int, seconds: float) -> None:
        self._buckets.setdefault(batch_bucket(batch_size), _Bucket()).add(candidate, seconds)

    def _add_tau(self, candidate: int, tokens: Sequence[int]) -> None:
        self._tau.setdefault(candidate, _Tau()).add(tokens)

    def reset(self) -> None:
        """Forget every measurement (after a warm-up, whose rounds compile, or once compiled rounds
        replace eager ones: the costs measured before no longer hold)."""
        self._tau.clear()
        self._buckets.clear()
