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
    assert stand_in_from_env({**ON, STAND_IN_ENV: "8:10"}) == StandIn(8, 10.0, overlap=True)
    assert stand_in_from_env({**ON, STAND_IN_ENV: " 1:0.5 "}) == StandIn(1, 0.5)
    assert stand_in_from_env({**ON, STAND_IN_ENV: "16:0:serial"}) == StandIn(16, 0.0, overlap=False)
    assert stand_in_from_env({**ON, STAND_IN_ENV: "4:10:overlap"}) == StandIn(4, 10.0, overlap=True)
    for bad in ("8", "0:10", "-1:10", "x:1", "8:-1", "8:abc", ":5", "8:10:2", "2.5:10", "8:nan", "8:inf",
                "8:10:", "8:10:Serial", "8:10:serial:1"):  # fmt: skip
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
    assert runner.times.rounds == 1 and runner.times.round_s == pytest.approx(0.010)  # the device's time


def test_a_round_launched_before_the_last_is_committed_continues_the_cycle_after_it():
    """Overlap: round 2 is launched while round 1 is in flight, so it starts where round 1's tokens end,
    and the simulated device runs it after round 1: ready 10 ms after round 1 is."""
    clock = FakeClock(work=0.0)
    runner = StandInRunner(StandIn(3, 10.0), list(range(10, 20)), sleep=clock.sleep, clock=clock)
    a, b = _request(0, [1], 40), _request(1, [1], 40)
    a.output_ids, b.output_ids = [10], [10, 11]
    first = runner.launch_round([a, b], RoundShape(2, 0, (True, True, False, False, False)))
    clock.now += 0.004  # host work while round 1 runs
    second = runner.launch_round([a], RoundShape(2, 0, (True, True, False, False, False)))  # b ended
    out1 = first()
    assert [[*d, e] for d, e in zip(out1.drafts, out1.emitted)] == [[11, 12, 13], [12, 13, 14]]
    assert clock.slept == [pytest.approx(0.006)]  # round 1 was ready 10 ms after its launch
    a.output_ids += [11, 12, 13]  # the engine commits round 1
    out2 = second()
    assert [[*d, e] for d, e in zip(out2.drafts, out2.emitted)] == [[14, 15, 16]]
    assert clock.slept == [pytest.approx(0.006), pytest.approx(0.010)]  # the device ran round 2 after round 1
    a.output_ids += [14, 15, 16]
    third = runner.launch_round([a], RoundShape(2, 0, (True, True, False, False, False)))
    assert third().emitted == [19]  # round 2 was committed before round 3 was launched: no tokens ahead
    assert runner.times.rounds == 3 and runner.times.round_s == pytest.approx(0.030)


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


@pytest.mark.parametrize("mode", ["overlap", "serial"])
def test_the_llm_streams_k_tokens_per_round_to_max_tokens(monkeypatch, mode):
    from dflash_trt import LLM, SamplingParams

    monkeypatch.setenv("DFLASH_TRT_TESTING", "1")
    monkeypatch.setenv(STAND_IN_ENV, f"4:1:{mode}")
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


def _engine_with(stand_in: StandIn, clock: FakeClock):
    import torch

    from dflash_trt.engine.assemble import build_engine
    from dflash_trt.engine.config import EngineConfig
    from dflash_trt.tiny import ensure_tiny

    config = EngineConfig(max_batch_size=4, max_seq_len=96, compile=False)
    engine = build_engine(target_dir=ensure_tiny().target, drafter_dir=None, spec=None, tokenizer=None,
                          config=config, device=torch.device("cpu"), dtype=torch.float32)  # fmt: skip
    engine.runner = StandInRunner(stand_in, list(range(40, 50)), sleep=clock.sleep, clock=clock)
    return engine


def _serve(engine, clock: FakeClock, jobs: list[int], *, host_s: float, cancel_at: int | None = None):
    """Step the engine until it is idle, `host_s` of host work after each step (the LLM's delivery);
    request 0 is cancelled after step `cancel_at`. Returns each request's tokens and finish reason, the
    simulated time it took and each step's updates as (request, tokens)."""
    from dflash_trt.engine.request import RequestParams

    reqs = [engine.add_request([1, 2, 3], RequestParams(max_tokens=n, ignore_eos=True)) for n in jobs]
    t0, steps = clock.now, []
    while engine.has_work():
        steps.append([(reqs.index(u.req), list(u.new_token_ids)) for u in engine.step()])
        clock.now += host_s
        if len(steps) == cancel_at:
            engine.abort(reqs[0].request_id)
    return [(r.output_ids, r.finish_reason) for r in reqs], clock.now - t0, steps


def test_an_overlapping_engine_hides_host_work_under_the_rounds_and_commits_the_same_tokens():
    """4 ms of host work a step: serial rounds cost 10 + 4 ms each, overlapped ones 10 ms (the device is
    never idle); every request gets the same tokens either way, to its own max_tokens (1 + 4 a round,
    so request 1 ends mid-round: its last round is cut, and the overlapped round launched after it is
    dropped)."""
    results, elapsed, streams = {}, {}, {}
    for overlap in (True, False):
        clock = FakeClock(work=0.0)
        engine = _engine_with(StandIn(4, 10.0, overlap), clock)
        results[overlap], elapsed[overlap], streams[overlap] = _serve(
            engine, clock, [21, 11, 17], host_s=0.004
        )
    assert results[True] == results[False]
    (a, ra), (b, rb), (c, rc) = results[True]
    assert (len(a), len(b), len(c)) == (21, 11, 17) and ra == rb == rc == "length"
    assert a == [40 + i % 10 for i in range(21)]  # the cycle, no token skipped nor repeated
    # five rounds after the prefill step: serial 4 + 5 x (10 + 4) ms. Overlapped, request 0's round 6 is
    # launched before its round 5 is committed (as TensorRT-LLM's overlap scheduler does: the engine does
    # not know a round's length before it ends), then dropped: the prefill step's 4 ms, 6 x 10 on the device
    # (each round queued behind the last, the host's 4 ms a step hidden under them), 4 after the last
    assert elapsed[False] == pytest.approx(0.004 + 5 * 0.014)
    assert elapsed[True] == pytest.approx(0.004 + 6 * 0.010 + 0.004)
    # each step's updates reach the caller in round order, a round's tokens whole
    for overlap in (True, False):
        got = {i: [t for step in streams[overlap] for j, ts in step if j == i for t in ts] for i in range(3)}
        assert got == {i: results[True][i][0] for i in range(3)}


@pytest.mark.parametrize("overlap", [True, False])
def test_a_request_cancelled_while_its_round_is_in_flight_gets_no_more_tokens(overlap):
    clock = FakeClock(work=0.0)
    engine = _engine_with(StandIn(4, 10.0, overlap), clock)
    results, _, steps = _serve(engine, clock, [41, 9], host_s=0.001, cancel_at=2)
    (a, ra), (b, rb) = results
    assert ra == "cancelled" and rb == "length" and len(b) == 9
    # the prefill step, one committed round (serial) or none yet (overlap), then the cancellation
    assert len(a) == (5 if not overlap else 1)
    assert all(i != 0 or not ts for step in steps[2:] for i, ts in step)
    assert not engine.has_work() and engine.scheduler.num_active == 0


def test_fail_all_drops_the_round_in_flight():
    clock = FakeClock(work=0.0)
    engine = _engine_with(StandIn(4, 10.0), clock)
    from dflash_trt.engine.request import RequestParams

    req = engine.add_request([1, 2, 3], RequestParams(max_tokens=30, ignore_eos=True))
    engine.step()  # the prefill, and round 1 launched
    assert engine.has_work()
    updates = engine.fail_all()
    assert [(u.req, u.finished) for u in updates] == [(req, True)] and req.finish_reason == "error"
    assert req.output_ids == [40] and not engine.has_work()
