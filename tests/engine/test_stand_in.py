# SPDX-License-Identifier: Apache-2.0
"""The stand-in engine of the serving path's benchmark (engine/stand_in.py): its switch, its rounds,
and the LLM API on top of it (the served path: tests/serving/test_stand_in_serve.py)."""

from __future__ import annotations

import logging

import pytest

from dflash_trt.engine.request import Request
from dflash_trt.engine.round import RoundShape
from dflash_trt.engine.stand_in import STAND_IN_ENV, StandIn, StandInRunner, printable_ids, stand_in_from_env
from dflash_trt.errors import ConfigError

ON = {"DFLASH_TRT_TESTING": "1"}


def test_switch_needs_the_testing_flag_and_a_valid_value(caplog):
    assert stand_in_from_env({}) is None
    assert stand_in_from_env(ON) is None
    with caplog.at_level(logging.WARNING, logger="dflash_trt.engine.stand_in"):
        assert stand_in_from_env({STAND_IN_ENV: "8:10"}) is None  # ignored without the flag
    assert "DFLASH_TRT_STAND_IN='8:10' ignored: the stand-in engine needs DFLASH_TRT_TESTING=1" in caplog.text
    assert stand_in_from_env({**ON, STAND_IN_ENV: "8:10"}) == StandIn(8, 10.0)
    assert stand_in_from_env({**ON, STAND_IN_ENV: " 1:0.5 "}) == StandIn(1, 0.5)
    assert stand_in_from_env({**ON, STAND_IN_ENV: "16:0"}) == StandIn(16, 0.0)
    for bad in ("8", "0:10", "-1:10", "x:1", "8:-1", "8:abc", ":5", "8:10:2", "2.5:10", "8:nan", "8:inf"):
        with pytest.raises(ConfigError, match=r"DFLASH_TRT_STAND_IN='.*': is not TOKENS_PER_ROUND:ROUND_MS"):
            stand_in_from_env({**ON, STAND_IN_ENV: bad})


def _request(rid: int, prompt: list[int], max_tokens: int) -> Request:
    return Request(request_id=rid, prompt_ids=prompt, max_len=len(prompt) + max_tokens, temperature=0.0, top_k=0,
                   top_p=1.0, seed=0, greedy_draft=False, stop_token_ids=frozenset(), stop_strings=(),
                   min_tokens=0, include_stop_str_in_output=False)  # fmt: skip


class FakeClock:
    """A clock that host work advances by `work` per reading, and `sleep` by what it is asked."""

    def __init__(self, work: float) -> None:
        self.now, self.work, self.slept = 100.0, work, []

    def __call__(self) -> float:
        self.now += self.work
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def test_rounds_emit_k_tokens_each_and_last_round_ms():
    clock = FakeClock(work=0.001)
    runner = StandInRunner(StandIn(3, 10.0), [7, 8, 9, 10, 11], sleep=clock.sleep, clock=clock)
    a, b = _request(0, [1, 2, 3], 20), _request(1, [4, 5], 20)
    first = runner.prefill([a, b], [(0, 3), (0, 1)])  # b's prompt is not complete yet
    assert first.tokens == [7, None] and first.logprobs == [None, None] and first.forked == ()
    a.output_ids = [7]
    b.output_ids = [7, 8, 9, 10]
    out = runner.decode_round([a, b], RoundShape(5, 0, (True, True, False, False, False)))
    assert out.accepted == [2, 2] and out.drafted == [2, 2] and out.overturned == [0, 0]
    rounds = [[*d, e] for d, e in zip(out.drafts, out.emitted)]
    assert rounds == [[8, 9, 10], [11, 7, 8]]  # the cycle, at each request's output position
    assert out.path == [[0, 1, 2], [0, 1, 2]] and out.logprobs is None
    # the clock read 0.001 s after the round's start when it slept: it slept the rest of the 10 ms
    assert clock.slept == [pytest.approx(0.009)]
    assert runner.times.rounds == 1 and runner.times.round_s == pytest.approx(0.011)


def test_a_round_slower_than_round_ms_does_not_sleep():
    clock = FakeClock(work=0.02)
    runner = StandInRunner(StandIn(1, 10.0), [5], sleep=clock.sleep, clock=clock)
    req = _request(0, [1], 4)
    req.output_ids = [5]
    out = runner.decode_round([req], RoundShape(0, 0, (True, True, False, False, False)))
    assert out.accepted == [0] and out.drafts == [[]] and out.emitted == [5]
    assert clock.slept == []


def test_prefill_starts_a_leaders_siblings():
    runner = StandInRunner(StandIn(2, 0.0), [3, 4])
    leader, sib = _request(0, [1, 2], 8), _request(1, [1, 2], 8)
    leader.siblings = [sib]
    out = runner.prefill([leader], [(0, 2)])
    assert out.tokens == [3] and out.forked == ((sib, 3, None),)
    assert leader.siblings == [] and sib.prefilled == 2


def test_printable_ids_skip_specials_end_ids_and_unprintable_text():
    from dflash_trt.tiny import build_byte_tokenizer

    tok = build_byte_tokenizer()
    ids = printable_ids(tok, len(tok), avoid=[tok.convert_tokens_to_ids("a")])
    texts = [tok.decode([i]) for i in ids]
    assert len(ids) == 64 and len(set(ids)) == 64
    assert all(len(t) == 1 and t.isascii() and t.isprintable() and t != " " for t in texts), texts
    assert "a" not in texts and not set(ids) & set(tok.all_special_ids)
    assert printable_ids(None, 10, avoid=[0, 2]) == [1, 3, 4, 5, 6, 7, 8, 9]
    with pytest.raises(ConfigError, match="DFLASH_TRT_STAND_IN='': finds no printable token among 3 ids"):
        printable_ids(None, 3, avoid=[0, 1, 2])


def test_the_llm_streams_k_tokens_per_round_to_max_tokens(monkeypatch):
    from dflash_trt import LLM, SamplingParams

    monkeypatch.setenv("DFLASH_TRT_TESTING", "1")
    monkeypatch.setenv(STAND_IN_ENV, "4:0")
    with LLM("tiny", max_batch_size=4, max_seq_len=128, compile=False) as llm:
        sp = SamplingParams(max_tokens=1 + 4 * 5, ignore_eos=True, return_perf_metrics=True)
        handles = [llm.generate_async("def f(", sp, streaming=True) for _ in range(3)]
        items = [list(h) for h in handles]
    for outs in items:
        counts = [len(o.outputs[0].token_ids) for o in outs]
        # the prefill's token, then whole rounds of 4 (a stream may merge rounds that arrive together)
        assert counts[-1] == 21 and all(c % 4 == 1 for c in counts), counts
        final = outs[-1].outputs[0]
        assert final.finish_reason == "length" and len(final.text) == 21  # one printable byte per token
        assert final.request_perf_metrics is not None
        spec = final.request_perf_metrics.speculative_decoding
        assert spec.acceptance_lengths == [4] * 5 and spec.acceptance_rate == 1.0
        assert spec.total_draft_tokens == spec.total_accepted_draft_tokens == 15
