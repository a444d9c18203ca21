# SPDX-License-Identifier: Apache-2.0
"""The draft length per round: the user's schedule, or chosen by measured cost (the default)."""

from __future__ import annotations

import pytest
import torch

from dflash_trt import LLM, SamplingParams
from dflash_trt.engine.draft_len import DraftLenPolicy, auto_draft_lens
from dflash_trt.engine.round_policy import EXPLORE_ROUNDS
from tests.engine.test_llm import BLOCK, pair, spec  # noqa: F401  (pair: a fixture)
from tests.engine.test_tree_budget import fake_clock

K = 15
TAUS = {0: 1, 3: 3, 7: 4, 15: 5}  # tokens per request-round at each draft length


def cost(g: int, n: int) -> float:
    """A round: a fixed 1 s, plus 0.01 s per verified token of the batch (compute-bound at large n)."""
    return 1.0 + 0.01 * n * (g + 1)


def feed(policy: DraftLenPolicy, n: int, steps: int) -> list[int]:
    chosen = []
    for _ in range(steps):
        g = policy.choose(n)
        chosen.append(g)
        policy.record(g, n, cost(g, n), [TAUS[g] - 1] * n)
    return chosen


def best_by_formula(n: int) -> int:
    return max(TAUS, key=lambda g: (n * TAUS[g] / cost(g, n), -g))


def test_candidates_and_what_pins_them():
    assert auto_draft_lens(15) == (0, 3, 7, 15)
    assert auto_draft_lens(7) == (0, 3, 7)
    assert auto_draft_lens(3) == (0, 3)
    assert auto_draft_lens(1) == (0, 1)
    auto = DraftLenPolicy.for_spec(K)
    assert auto.auto and auto.draft_lens(1) == auto.draft_lens(8) == (0, 3, 7, 15)
    assert auto.tau(0) == 1.0  # plain decoding needs no measurement
    user = DraftLenPolicy.for_spec(K, {4: 15, 16: 7}.get)
    assert not user.auto and user.draft_lens(4) == (15,) and user.choose(16) == 7


def test_auto_explores_then_picks_the_best_rate_per_batch_size():
    policy = DraftLenPolicy.for_spec(K)
    policy.explore_every = 10_000
    # a new bucket: every candidate once unmeasured and EXPLORE_ROUNDS times measured, the smallest first
    first = feed(policy, 2, 4 * (1 + EXPLORE_ROUNDS))
    assert first == [g for g in (0, 3, 7, 15) for _ in range(1 + EXPLORE_ROUNDS)]
    assert {g: policy.tau(g) for g in TAUS} == TAUS
    assert set(feed(policy, 2, 20)) == {best_by_formula(2)} == {15}
    # a new bucket, its own costs (first rounds unmeasured); tau is known by now, so the full block, whose
    # 64 x 16 rows could not beat 3 drafts even at 7 drafts' cost, is never explored here
    assert best_by_formula(64) not in (15, 0)  # the cost model has a middle optimum here
    assert 64 * TAUS[15] / cost(7, 64) < 64 * TAUS[3] / cost(3, 64)
    assert feed(policy, 64, 3 * (1 + EXPLORE_ROUNDS)) == [
        g for g in (0, 3, 7) for _ in range(1 + EXPLORE_ROUNDS)
    ]
    assert set(feed(policy, 64, 20)) == {best_by_formula(64)}
    assert policy.round_seconds(15, 64) is None
    assert policy.summary()["draft_len"] == best_by_formula(64) and policy.summary()["draft_len_auto"]


def test_a_request_alone_is_chosen_by_cost_too():
    """At batch 1 the full block wins where a round is fixed cost (`tiny`), and plain decoding wins where
    the verify pass grows with the block and the drafter accepts little (a real vocabulary's head)."""
    fixed = DraftLenPolicy.for_spec(K)
    fixed.explore_every = 10_000
    feed(fixed, 1, 4 * (1 + EXPLORE_ROUNDS))
    assert set(feed(fixed, 1, 10)) == {15}
    weak = DraftLenPolicy.for_spec(K)
    weak.explore_every = 10_000
    for i in range(4 * (1 + EXPLORE_ROUNDS) + 10):
        g = weak.choose(1)
        weak.record(g, 1, 1.0 + 0.2 * g, [i % 2 if g else 0])  # tau about 1.5 at any length, 0.2 s a draft
    assert weak.last == 0 and weak.best(1) == 0


def test_user_schedule_rounds_are_not_measured():
    policy = DraftLenPolicy.for_spec(K, lambda n: K if n <= 4 else 0)
    assert feed(policy, 8, 3) == [0, 0, 0] and policy.round_seconds(0, 8) is None


def test_auto_in_the_engine_with_an_injected_clock(pair):  # noqa: F811
    """The engine times each round with its clock and feeds the policy: a request alone explores every
    draft length, then keeps the best rate; a full batch under a compute-bound clock backs off to plain decoding, the draft
    cache still fed every round, and greedy output stays the target's own (a --no-draft engine's)."""
    tdir, ddir, _ = pair
    prompts = [[i % 12 + 1, 2, (3 * i) % 13] for i in range(16)]
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    with LLM(str(tdir), max_batch_size=16, max_seq_len=128) as plain_llm:
        plain = [o.outputs[0].token_ids for o in plain_llm.generate(prompts, sp)]
    with LLM(str(tdir), speculative_config=spec(ddir), max_batch_size=16, max_seq_len=128) as llm:
        engine = llm.engine
        # the verify cost grows with the block
        rounds = fake_clock(engine, lambda n, g, _b: 1.0 + (0.0 if n == 1 else n * (g + 1) ** 2))
        engine.planner.draft_lens.explore_every = 10_000
        alone = llm.generate(prompts[:1], sp)[0].outputs[0].token_ids
        candidates = auto_draft_lens(BLOCK - 1)
        explored = len(candidates) * (1 + EXPLORE_ROUNDS)
        settled = {g for _, g, _ in rounds[explored:]}  # the test drafter is random: it accepts ~nothing
        assert settled == {engine.planner.draft_lens.best(1)}, rounds
        rounds.clear()
        batch = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        full = [g for n, g, _ in rounds if n == 16]
        # the smallest first; once 2 drafts cost 145 s a round here, the full block (tau <= 6) cannot beat
        # plain decoding's 16 tokens in 17 s even at that cost, and is never explored at this batch size
        assert candidates == (0, 2, 5) and full[:4] == [0, 0, 2, 2], full
        assert set(full[4:]) == {0}, full
        assert llm.get_stats()["draft_len"] == 0 and llm.get_stats()["draft_len_auto"]
    assert alone == plain[0] and batch == plain


def test_warm_up_runs_every_draft_length_and_leaves_no_measurement(pair):  # noqa: F811
    """The warm-up (what compiles rounds before traffic) runs every candidate draft length at batch 1
    and 2, greedy and sampled, and forgets its rounds' costs."""
    from dflash_trt.engine.assemble import build_engine
    from dflash_trt.engine.config import EngineConfig
    from dflash_trt.spec.decoding_config import DFlashDecodingConfig

    tdir, ddir, _ = pair
    engine = build_engine(target_dir=tdir, drafter_dir=ddir, spec=DFlashDecodingConfig.from_any(spec(ddir)),
                       tokenizer=None, config=EngineConfig(max_batch_size=2, max_seq_len=128),
                       device=torch.device("cpu"), dtype=torch.float32)  # fmt: skip
    seen = set()
    run = engine.runner.decode_round

    def spy(reqs, shape):
        seen.add((len(reqs), shape.g, reqs[0].temperature > 0))
        return run(reqs, shape)

    engine.runner.decode_round = spy
    engine.warm_up()
    k = BLOCK - 1
    expected = {(n, g, s) for n in (1, 2) for g in auto_draft_lens(k) for s in (False, True)}
    assert seen == expected
    policy = engine.planner.draft_lens
    assert policy is not None and policy.override is None and policy.tau(k) is None
    assert (
        policy.round_seconds(k, 2) is None and len(engine.warm_up_classes()) == len(expected) + 2
    )  # + prefill, batch 1 and 2+


def _spy_injections(engine) -> list[tuple[int, int, list[int], list[int]]]:
    """Per decode round: (batch size, drafts, the rows the round projected into the draft cache, the
    positions it expected committed: start .. start + accepted of each request)."""
    rounds: list[tuple[int, int, list[int], list[int]]] = []
    drafting = engine.runner.parts.backend.drafting
    inject, run = drafting.inject_context, engine.runner.decode_round
    projected: list[int] = []

    def spy_inject(cache, features, positions, slots):
        projected.extend(positions[slots != 0].tolist() + [-1] * int((slots == 0).sum()))
        return inject(cache, features, positions, slots)

    def spy_round(reqs, shape):
        starts = [s.start for s in reqs]
        projected.clear()
        out = run(reqs, shape)
        committed = [p for s, a in zip(starts, out.accepted, strict=True) for p in range(s, s + a + 1)]
        rounds.append((len(reqs), shape.g, list(projected), committed))
        return out

    drafting.inject_context, engine.runner.decode_round = spy_inject, spy_round
    return rounds


@pytest.mark.parametrize("tree_budget", [None, 8])
def test_a_round_injects_its_own_committed_positions_only(pair, tree_budget):  # noqa: F811
    """KV injection runs after acceptance and projects the round's own block, g + 1 rows a request: a
    round that drafts nothing projects one row a request (not a whole block's, the cost a drafting
    engine's plain rounds used to pay), and exactly the committed positions reach the draft cache,
    whatever the draft length does from round to round (chain and DDTree)."""
    tdir, ddir, _ = pair
    prompts = [[i % 12 + 1, 2, (3 * i) % 13] for i in range(8)]
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    kw = {} if tree_budget is None else {"tree_budget": tree_budget}
    with LLM(str(tdir), speculative_config=spec(ddir, **kw), max_batch_size=8, max_seq_len=128) as llm:
        engine = llm.engine
        rounds = _spy_injections(engine)
        # a request alone drafts; plain decoding wins in a batch
        fake_clock(engine, lambda n, g, _b: 1.0 + (0.0 if n == 1 else n * (g + 1) ** 2))
        llm.generate(prompts, sp)
    drafts = {g for _, g, _, _ in rounds}
    # a DDTree engine drafts all along
    assert max(drafts) > 0 and (tree_budget is not None or 0 in drafts), drafts
    for n, g, projected, committed in rounds:
        assert len(projected) == n * (g + 1), (n, g, len(projected))
        assert sorted(p for p in projected if p >= 0) == sorted(committed), (n, g)
