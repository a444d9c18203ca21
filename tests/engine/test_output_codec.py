# SPDX-License-Identifier: Apache-2.0
"""The compact form of outputs on the engine process's pipe (dflash_trt/api/output_codec.py): every
output decodes equal to what was encoded, growing values cross as their new part, and the two sides
keep nothing for a request after its final output."""

from __future__ import annotations

import datetime
import pickle
from dataclasses import replace

from dflash_trt.api.output_codec import OutputDecoder, OutputEncoder
from dflash_trt.api.outputs import (
    CompletionOutput,
    KvCacheMetrics,
    Logprob,
    RequestOutput,
    RequestPerfMetrics,
    SpeculativeDecodingMetrics,
    TimingMetrics,
)

PROMPT_IDS = list(range(100, 140))


def _td(s: float | None) -> datetime.timedelta | None:
    return None if s is None else datetime.timedelta(seconds=s)


def _metrics(step: int, budgets: bool) -> RequestPerfMetrics:
    lengths = [1 + (i % 4) for i in range(step)]
    return RequestPerfMetrics(
        TimingMetrics(_td(0.25), _td(0.5), _td(0.75) if step else None, _td(0.75 + 0.01 * step) if step else None),
        SpeculativeDecodingMetrics(0.5, step, 2 * step, lengths, sum(lengths) / max(step, 1), step, step // 3,
                                   [8] * step if budgets else None),
        KvCacheMetrics(2 + step, 1, 1, 0, 0.5),
    )  # fmt: skip


def _stream(n_steps: int, *, index: int = 0, budgets: bool = False) -> list[RequestOutput]:
    """A streamed request's snapshots: 4 tokens and their text per step, then a final one."""
    outs = []
    for step in range(1, n_steps + 1):
        ids = [(7 * i + 3 * index) % 50 for i in range(4 * step)]
        comp = CompletionOutput(
            index=index, text="".join(chr(65 + i % 26) for i in ids), token_ids=ids,
            finish_reason="length" if step == n_steps else None, text_diff="ABCD"[: step % 5],
            token_ids_diff=ids[-4:], request_perf_metrics=_metrics(step, budgets),
            logprobs=[{t: Logprob(-0.5 * t, 1)} for t in ids],
        )  # fmt: skip
        outs.append(RequestOutput(7, "def f():", PROMPT_IDS, [comp], step == n_steps, num_cached_tokens=16))
    return outs


def _roundtrip(enc: OutputEncoder, dec: OutputDecoder, key: int, out: RequestOutput) -> tuple:
    wire = pickle.loads(pickle.dumps(enc.encode(key, out)))  # what the pipe carries
    got_key, got = dec.decode(wire)
    assert got_key == key
    return wire, got


def test_a_streamed_request_decodes_equal_at_every_output_and_sends_only_what_is_new():
    enc, dec = OutputEncoder(), OutputDecoder()
    outs = _stream(12, budgets=True)
    for step, out in enumerate(outs, start=1):
        wire, got = _roundtrip(enc, dec, 3, out)
        assert got == out
        comp = wire[3][0]
        assert (wire[2] is not None) == (step == 1)  # the prompt crosses once
        base, tail = comp[2]  # token_ids: the previous output's ids, then four new ones
        assert base == 4 * (step - 1) and len(tail) == 4
        assert comp[6] is None  # token_ids_diff equals the new ids: not sent twice
    assert not enc._sent and not dec._sent  # nothing kept after the final output


def test_values_that_do_not_grow_from_the_last_ones_cross_whole():
    """A text that changed inside (a held-back stop string released differently), ids that shrank,
    and a tail-only change: each decodes equal."""
    enc, dec = OutputEncoder(), OutputDecoder()
    first, second, third = _stream(3)
    _roundtrip(enc, dec, 1, first)
    changed = replace(second, outputs=[replace(second.outputs[0], text="zz" + second.outputs[0].text[2:])])
    wire, got = _roundtrip(enc, dec, 1, changed)
    assert got == changed and wire[3][0][1][0] == 0  # text sent whole
    shrunk = replace(third, outputs=[replace(third.outputs[0], token_ids=third.outputs[0].token_ids[:2])])
    wire, got = _roundtrip(enc, dec, 1, shrunk)
    assert got == shrunk and wire[3][0][2] == (0, shrunk.outputs[0].token_ids)


def test_requests_interleave_and_sequences_keep_their_own_bases():
    """Two requests in one stream of messages, one of them with two sequences (n = 2) whose final
    output is ranked (best_of: the indices change): every output decodes equal."""
    enc, dec = OutputEncoder(), OutputDecoder()
    a, b0, b1 = _stream(5), _stream(5, index=0), _stream(5, index=1)
    for step in range(5):
        pair = [b0[step].outputs[0], b1[step].outputs[0]]
        if step == 4:  # ranked: sequence 1 first, re-indexed
            pair = [replace(pair[1], index=0), replace(pair[0], index=1)]
        both = replace(b0[step], outputs=pair)
        assert _roundtrip(enc, dec, 1, a[step])[1] == a[step]
        wire, got = _roundtrip(enc, dec, 2, both)
        assert got == both
        assert (wire[3][0][2][0] == 0) == (step in (0, 4))  # whole at the start and once re-indexed
    assert not enc._sent and not dec._sent


def test_a_forgotten_request_is_sent_whole_again():
    """The link forgets a request whose message could not be sent: its next output decodes equal on
    a decoder that never saw the lost one."""
    enc, dec = OutputEncoder(), OutputDecoder()
    outs = _stream(4)
    _roundtrip(enc, dec, 9, outs[0])
    enc.encode(9, outs[1])  # encoded, then lost on the way
    enc.forget([9])
    wire, got = _roundtrip(enc, dec, 9, outs[2])
    assert got == outs[2] and wire[2] is not None  # prompt and values whole again


def test_outputs_without_metrics_or_logprobs_and_with_an_error():
    enc, dec = OutputEncoder(), OutputDecoder()
    bare = RequestOutput(5, None, [1, 2], [CompletionOutput(0, "", [])], False)
    failed = RequestOutput(5, None, [1, 2], [CompletionOutput(0, "ab", [3, 4], finish_reason="error")], True,
                           error="engine failure: boom")  # fmt: skip
    assert _roundtrip(enc, dec, 4, bare)[1] == bare
    assert _roundtrip(enc, dec, 4, failed)[1] == failed
