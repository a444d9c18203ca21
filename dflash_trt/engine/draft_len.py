# SPDX-License-Identifier: Apache-2.0
"""The draft length of a round, chosen from measured costs and acceptance (the automatic
draft_len_schedule).

A round at batch size n with g drafts per request costs c(n, g) seconds and yields, per request,
E[tokens | g] = 1 + sum_{j<=g} prod_{i<=j} a_i, where a_j is the probability that draft j is
accepted given that drafts 1..j-1 were. The policy picks the g in a small ladder that maximises
n * E[tokens | g] / c(n, g): long blocks where verifying is cheap (batch 1 on a GPU, or any batch
while the verify pass is overhead-bound), shorter ones, down to 0 (speculation off), once the verify
pass becomes compute-bound.

- a_j are counted over every round of every request (exponentially decayed, so the estimate follows
  the traffic), starting from an optimistic prior so that untried lengths get tried.
- c(n, g) is an exponential moving average per (n, g) of measured round wall times. An unmeasured
  cell is estimated from the measured cells of the same n by a fit linear in the verified tokens
  (n * (g + 1)); with one measured cell, the fit scales it; with none, the cell is tried.
- Every EXPLORE_EVERY rounds at a batch size, the best length's neighbour on the ladder is run once
  more, so that a cost that drifts (longer contexts) is noticed.

A user-given draft_len_schedule or max_concurrency pins the lengths instead (spec/decoding_config.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

EXPLORE_EVERY = 64  # rounds at one batch size between two runs of a neighbouring length
COST_DECAY = 0.8  # EMA weight of the previous cost estimate
ACCEPT_DECAY = 0.999  # per-round decay of the acceptance counts
PRIOR_ACCEPT = 0.8  # optimistic prior acceptance per position, worth PRIOR_WEIGHT rounds
PRIOR_WEIGHT = 2.0


def ladder(max_draft_len: int) -> tuple[int, ...]:
    """The lengths considered: 0 and roughly doubling block sizes up to the maximum (0, 1, 3, 7, 15)."""
    out, g = [0], 1
    while g < max_draft_len:
        out.append(g)
        g = 2 * g + 1
    out.append(max_draft_len)
    return tuple(sorted(set(out)))


@dataclass
class DraftLengthPolicy:
    max_draft_len: int
    lengths: tuple[int, ...] = ()
    reached: list[float] = field(default_factory=list)  # [g]: decayed rounds in which draft j was judged
    accepted: list[float] = field(default_factory=list)  # [g]: ... and accepted
    cost: dict[tuple[int, int], float] = field(default_factory=dict)  # (n, g) -> seconds (EMA)
    rounds_at: dict[int, int] = field(default_factory=dict)  # n -> rounds run at that batch size

    def __post_init__(self) -> None:
        self.lengths = self.lengths or ladder(self.max_draft_len)
        self.reached = [PRIOR_WEIGHT] * self.max_draft_len
        self.accepted = [PRIOR_WEIGHT * PRIOR_ACCEPT] * self.max_draft_len

    # --- observations ---------------------------------------------------------------------------
    def observe(
        self, batch_size: int, draft_len: int, seconds: float, accepted: list[int], judged: list[int]
    ) -> None:
        """One round: its wall time, and per request the drafts accepted and the drafts it could
        accept (its block's drafts; fewer than draft_len near max_tokens)."""
        key = (batch_size, draft_len)
        old = self.cost.get(key)
        self.cost[key] = seconds if old is None else COST_DECAY * old + (1 - COST_DECAY) * seconds
        self.rounds_at[batch_size] = self.rounds_at.get(batch_size, 0) + 1
        if draft_len == 0:
            return
        decay = ACCEPT_DECAY ** len(accepted)
        self.reached = [r * decay for r in self.reached]
        self.accepted = [a * decay for a in self.accepted]
        for acc, n in zip(accepted, judged):
            # drafts 1..acc were accepted; draft acc+1 (if judged) was rejected; later ones never judged
            for j in range(min(acc + 1, n)):
                self.reached[j] += 1.0
                if j < acc:
                    self.accepted[j] += 1.0

    # --- the choice -----------------------------------------------------------------------------
    def expected_tokens(self, g: int) -> float:
        """E[tokens per request per round | g] under the current acceptance estimate."""
        total, p = 1.0, 1.0
        for j in range(g):
            p *= self.accepted[j] / self.reached[j]
            total += p
        return total

    def choose(self, batch_size: int) -> int:
        n = batch_size
        estimates = {g: self._estimate_cost(n, g) for g in self.lengths}
        untried = [g for g, c in estimates.items() if c is None]
        if untried:
            return max(untried)  # longest first: the common best at small batches
        best = max(self.lengths, key=lambda g: self.expected_tokens(g) / estimates[g])  # type: ignore[operator]
        if self.rounds_at.get(n, 0) % EXPLORE_EVERY == EXPLORE_EVERY - 1:
            i = self.lengths.index(best)
            neighbours = [self.lengths[j] for j in (i - 1, i + 1) if 0 <= j < len(self.lengths)]
            return neighbours[(self.rounds_at[n] // EXPLORE_EVERY) % len(neighbours)]
        return best

    def _estimate_cost(self, n: int, g: int) -> float | None:
        measured = {gg: c for (nn, gg), c in self.cost.items() if nn == n}
        if g in measured:
            return measured[g]
        if not measured:
            return None
        if len(measured) == 1:
            ((g0, c0),) = measured.items()
            return None if g0 == 0 else c0 * (g + 1) / (g0 + 1)
        # least squares c = a + b * (g + 1) over the measured lengths of this batch size
        xs = [gg + 1 for gg in measured]
        ys = list(measured.values())
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
        return max(1e-9, my + max(b, 0.0) * ((g + 1) - mx))

    def snapshot(self) -> dict[str, object]:
        """For metrics and logs: per-position acceptance and the lengths chosen so far."""
        return {
            "acceptance_per_position": [round(a / r, 4) for a, r in zip(self.accepted, self.reached)],
            "rounds_at_batch_size": dict(self.rounds_at),
        }
