# SPDX-License-Identifier: Apache-2.0
"""The DDTree budget policy: pinned budgets, and "auto" choosing by measured tokens per second.
Costs are injected (a cost table, or a fake clock around the engine's rounds): no timed asserts."""

from __future__ import annotations

import pytest

from dflash_trt import LLM, SamplingParams
from dflash_trt.engine.tree_budget import AUTO_BUDGETS, EXPLORE_ROUNDS, BudgetPolicy, batch_bucket
from dflash_trt.errors import ConfigError
from tests.engine.test_llm import pair, spec  # noqa: F401  (pair: a fixture)

# The candidate trees, small to large (the auto set: 15, 31, 63 nodes).
_, S, M, L = AUTO_BUDGETS
# The accepted path's node indices at depths 1..5 in the largest tree: a tree of b nodes keeps the
# prefix numbered <= b, so budgets S, M, L accept 3, 4, 5 drafts (tau 4, 5, 6); the chain accepts 3.
PATH = [1, 2, 3, 20, 40]
TAUS = {0: 4, S: 4, M: 5, L: 6}
# The first bucket: the candidates in turn, biggest first, once unmeasured (a budget's first round)
# and EXPLORE_ROUNDS times measured; a later bucket: only the measured turns.
EXPLORATION = [L, M, S, 0] * (1 + EXPLORE_ROUNDS)
NEW_BUCKET = EXPLORATION  # a first round in any bucket is not measured (it may compile)


def feed(policy: BudgetPolicy, n: int, steps: int, cost) -> list[int]:
    """Run `steps` choices at batch n; each round costs cost(b, n) seconds and every request accepts
    TAUS[b] - 1 drafts along PATH."""
    chosen = []
    for _ in range(steps):
        b = policy.choose(n)
        chosen.append(b)
        a = TAUS[b] - 1
        path = [0, *PATH[:a]] + [0] * (15 - a)
        policy.record(b, n, cost(b, n), [a] * n, [path] * n)
    return chosen


def fake_clock(engine, cost) -> list[tuple[int, int, int]]:
    """Time `engine`'s rounds with a fake clock: a round of n requests drafting g tokens at DDTree budget
    b costs cost(n, g, b) seconds. Returns the list each round is recorded in, as (n, g, b)."""
    clock, rounds = [0.0], []
    run = engine.runner.decode_round

    def timed(reqs, shape):
        out = run(reqs, shape)
        clock[0] += cost(len(reqs), shape.g, shape.budget)
        rounds.append((len(reqs), shape.g, shape.budget))
        return out

    engine.runner.decode_round = timed
    engine.clock = lambda: clock[0]
    return rounds


def test_pinned_and_config_forms():
    assert BudgetPolicy.from_config(None).budgets() == (0,) and BudgetPolicy.from_config(0).max_budget == 0
    pinned = BudgetPolicy.from_config(24)
    assert pinned.choose(1) == 24 and pinned.choose(64) == 24 and not pinned.auto
    auto = BudgetPolicy.from_config("auto")
    assert auto.auto and auto.budgets() == AUTO_BUDGETS and auto.max_budget == max(AUTO_BUDGETS)
    with pytest.raises(ConfigError, match="tree_budget='some'"):
        BudgetPolicy.from_config("some")
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 16, 17)] == [1, 2, 4, 8, 16, 32]


def test_auto_explores_then_follows_the_cost_per_token():
    """A round costs a fixed 30 s plus 0.1 s per verified row (the chain verifies 16 per request, a
    tree b + 1). At batch 1 the fixed cost dominates and the biggest tree wins; at batch 32 the
    rows dominate and the chain does."""

    def cost(b: int, n: int) -> float:
        return 30.0 + 0.1 * n * (b + 1 if b else 16)

    policy = BudgetPolicy(candidates=AUTO_BUDGETS, explore_every=1000)
    # the candidates in turn, the biggest tree first (it also measures the smaller trees' tau)
    assert feed(policy, 1, len(EXPLORATION), cost) == EXPLORATION
    assert {b: policy.tau(b) for b in AUTO_BUDGETS} == pytest.approx(TAUS)
    assert feed(policy, 1, 5, cost) == [L] * 5
    # batch 32 is another bucket: explored, then the chain
    assert feed(policy, 32, len(NEW_BUCKET) + 5, cost) == NEW_BUCKET + [0] * 5
    rates = {b: policy.rate(b, 32) for b in AUTO_BUDGETS}
    assert rates == pytest.approx({b: 32 * TAUS[b] / cost(b, 32) for b in AUTO_BUDGETS})
    assert policy.best(32) == 0 and policy.best(1) == L and policy.summary()["tree_budget"] == 0


def test_auto_reexplores_and_follows_a_change():
    """Every explore_every-th step of a bucket re-measures another candidate (mostly a neighbour of the
    best), so trees that got cheaper (a quieter machine, another workload) are picked up again."""
    expensive = {"tree": True}

    def cost(b: int, n: int) -> float:
        return 10.0 * (3.0 if b and expensive["tree"] else 1.0)

    policy = BudgetPolicy(explore_every=4)
    start = len(EXPLORATION)
    chosen = feed(policy, 1, start + 32, cost)
    exploring = [i >= start and i % 4 == 3 for i in range(start + 32)]
    assert {b for b, e in zip(chosen[start:], exploring[start:]) if not e} == {0}  # the chain wins
    # the chain's one neighbour twice, then a farther candidate, each in turn
    assert [b for b, e in zip(chosen, exploring) if e] == [S, S, M, S, S, L, S, S]
    expensive["tree"] = False
    chosen = feed(policy, 1, 240, cost)
    settled = [b for i, b in enumerate(chosen, start=start + 32) if i % 4 != 3][-40:]
    assert settled == [L] * 40  # once the explorations brought the trees' cost down


def test_auto_is_not_fooled_by_a_load_change():
    """The machine gets 3x slower while the best budget runs: every cost is kept relative to the
    budget in use, so the choice stays (absolute averages would make the stale others look cheap)."""
    load = {"factor": 1.0}

    def cost(b: int, n: int) -> float:
        return load["factor"] * (30.0 + 0.1 * n * (b + 1 if b else 16))

    policy = BudgetPolicy(explore_every=10)
    start = len(EXPLORATION) + 10
    chosen = feed(policy, 1, start, cost)
    assert {b for i, b in enumerate(chosen) if i >= len(EXPLORATION) and i % 10 != 9} == {L}
    load["factor"] = 3.0
    chosen = feed(policy, 1, 64, cost)
    assert {b for i, b in enumerate(chosen, start=start) if i % 10 != 9} == {L}  # besides the explorations
    assert policy.round_seconds(0, 1) == pytest.approx(cost(0, 1), rel=0.1)  # at the new load


def test_auto_in_the_engine_with_an_injected_clock(pair):  # noqa: F811
    """The engine times each round with its clock and feeds the policy. With a fake clock whose
    rounds cost a flat second alone and 0.5 s per verified row in a batch (a compute-bound verify;
    a tree's rows 1 s, for its mask, walk and compaction; alone, a shorter chain or plain decoding 3 s), a
    request alone runs trees and a full batch backs off to the chain, whose length the draft-length
    policy chooses as in linear DFlash. The per-round budgets reach the request metrics and the engine
    stats."""
    tdir, ddir, _ = pair
    with LLM(str(tdir), speculative_config=spec(ddir, tree_budget="auto"), max_batch_size=16,
             max_seq_len=256) as llm:  # fmt: skip
        engine, k = llm.engine, llm.engine.planner.max_draft_len
        rounds = fake_clock(
            engine,
            lambda n, g, b: (
                (1.0 if g == k else 3.0) if n == 1 else 1.0 + 0.5 * n * (2 * (b + 1) if b else g + 1)
            ),
        )
        engine.planner.budgets.explore_every = 10_000  # no re-exploration (its own test above)
        engine.planner.draft_lens.explore_every = 10_000
        sp = SamplingParams(max_tokens=120, return_perf_metrics=True)
        alone = llm.generate([1, 2, 3], sp).outputs[0].request_perf_metrics.speculative_decoding
        assert alone.tree_budgets == [b for _, _, b in rounds]
        # at batch 1 the draft-length policy explores the chains too; its full-block rounds explore the trees
        assert [b for _, g, b in rounds if g == k][: len(EXPLORATION)] == EXPLORATION
        settled = rounds[len(EXPLORATION) + 3 * (1 + EXPLORE_ROUNDS) :]
        assert settled and all(g == k and b > 0 for _, g, b in settled)
        assert llm.get_stats()["tree_budget"] > 0
        rounds.clear()
        llm.generate([[i % 12 + 1, 2] for i in range(16)], sp)
        # a full batch: the draft-length policy picks the chain's length (it may rule the full block out
        # unexplored: engine/round_policy.py); only full-block rounds may verify a tree, and those back off
        # to the chain once the new bucket's budgets were explored
        full = [(g, b) for n, g, b in rounds if n == 16]
        block = [b for g, b in full if g == k]
        explored = block[: len(NEW_BUCKET)]  # the draft-length policy may leave the full block earlier
        assert explored == NEW_BUCKET[: len(explored)] and set(block[len(NEW_BUCKET) :]) <= {0}
        assert {b for g, b in full if g != k} <= {0} and len(full) > 10 and all(b == 0 for _, b in full[-10:])
    assert llm.engine.planner.budgets.tau(L) >= llm.engine.planner.budgets.tau(S)


def test_warm_up_runs_every_budget_and_its_rounds_are_not_measured(pair):  # noqa: F811
    """A warm-up (what compiles the rounds before traffic) runs every budget `auto` may choose, in
    both sampling modes, and leaves no measurement behind: compiling rounds would mislead the choice."""
    import torch

    from dflash_trt.engine.assemble import build_engine
    from dflash_trt.engine.config import EngineConfig
    from dflash_trt.spec.decoding_config import DFlashDecodingConfig

    tdir, ddir, _ = pair
    engine = build_engine(target_dir=tdir, drafter_dir=ddir, spec=DFlashDecodingConfig.from_any(spec(ddir, tree_budget="auto")),
                       tokenizer=None, config=EngineConfig(max_batch_size=2, max_seq_len=128), device=torch.device("cpu"),
                       dtype=torch.float32)  # fmt: skip
    seen = []
    run = engine.runner.decode_round

    def spy(reqs, shape):
        seen.append((shape.budget, reqs[0].temperature > 0))
        return run(reqs, shape)

    engine.runner.decode_round = spy
    engine.warm_up()
    assert set(seen) == {(b, sampled) for b in AUTO_BUDGETS for sampled in (False, True)}
    assert engine.planner.budgets.override is None and engine.planner.budgets.tau(S) is None
    assert engine.planner.budgets.round_seconds(L, 1) is None and engine.planner.budgets.choose(1) == max(
        AUTO_BUDGETS
    )
