# SPDX-License-Identifier: Apache-2.0
"""RequestOutputs in a compact form for the engine process's pipe (api/process.py).

A streamed request's every output is a snapshot: it repeats all the request has produced so far (its
token ids, text, per-round acceptance lengths), and the perf-metric dataclasses pickle slowly (each one
a class reference and a dict of its fields). At c=64 on the stand-in engine, pickling one step's 64
outputs held the child's GIL for ~0.8 ms and unpickling them cost the parent (the Triton stub) ~0.9 ms
(bench/README.md, "The engine process's pipe in a compact form").

`OutputEncoder` (the child's writer thread) turns an output into nested tuples: every growing value
(text, token_ids, logprobs, acceptance_lengths, tree_budgets) as (n, tail) -- the first n items of
what this request last sent under that name, then `tail` -- when that is a prefix of it, else (0, all
of it); the prompt only in a request's first output; timedeltas as integer microseconds.
`OutputDecoder` (the parent's reader thread) rebuilds an equal RequestOutput. Both keep per request
what was sent last, until its final output; they stay in step because the pipe keeps the order and
one thread on each side codes every output.
"""

from __future__ import annotations

import datetime
from typing import Any

from dflash_trt.api.outputs import (
    CompletionOutput,
    KvCacheMetrics,
    RequestOutput,
    RequestPerfMetrics,
    SpeculativeDecodingMetrics,
    TimingMetrics,
)

Wire = tuple[Any, ...]
_US = datetime.timedelta(microseconds=1)


class _Sent:
    """One request's growing values as the other side holds them: (sequence index, name) -> value."""

    def __init__(self) -> None:
        self.values: dict[tuple[int, str], Any] = {}
        self.prompt: tuple[str | None, list[int]] | None = None


def _tail(sent: _Sent, slot: tuple[int, str], value: Any) -> tuple[int, Any] | None:
    """`value` as (n, tail) against what was sent under `slot`; remembers `value` as sent."""
    if value is None:
        return None
    prev = sent.values.get(slot)
    sent.values[slot] = value
    if prev:
        n = len(prev)
        if n <= len(value) and value[:n] == prev:
            return n, value[n:]
    return 0, value


def _grown(sent: _Sent, slot: tuple[int, str], wire: tuple[int, Any] | None) -> Any:
    """The value `_tail` encoded as `wire`: a new list or str, kept as the base of the next (outputs
    are snapshots, not to be changed in place: the LLM in process shares lists between them too)."""
    if wire is None:
        return None
    n, value = wire
    if n:
        prev = sent.values[slot]
        value = (prev if n == len(prev) else prev[:n]) + value
    sent.values[slot] = value
    return value


def _us(td: datetime.timedelta | None) -> int | None:
    return None if td is None else td // _US


def _td(us: int | None) -> datetime.timedelta | None:
    return None if us is None else _US * us  # the fastest exact way back (a keyword call costs 4x)


class OutputEncoder:
    """The child's side: `encode(key, output)` -> a picklable tuple (module docstring)."""

    def __init__(self) -> None:
        self._sent: dict[int, _Sent] = {}

    def encode(self, key: int, out: RequestOutput) -> Wire:
        sent = self._sent.get(key)
        if sent is None:
            sent = self._sent[key] = _Sent()
        prompt = None
        if sent.prompt is None:
            prompt = sent.prompt = (out.prompt, out.prompt_token_ids)
        comps = tuple(self._completion(sent, c) for c in out.outputs)
        if out.finished:
            del self._sent[key]
        return key, out.request_id, prompt, comps, out.finished, out.error, out.num_cached_tokens

    def forget(self, keys: list[int]) -> None:
        """Drop what is kept for `keys`: their next output goes whole (a message that was encoded but
        not sent must not become the base of the next)."""
        for key in keys:
            self._sent.pop(key, None)

    def _completion(self, sent: _Sent, c: CompletionOutput) -> Wire:
        i = c.index
        ids = _tail(sent, (i, "token_ids"), c.token_ids)
        same_diff = ids is not None and c.token_ids_diff == ids[1]  # the usual case: sent once
        return (
            i,
            _tail(sent, (i, "text"), c.text),
            ids,
            c.finish_reason,
            c.stop_reason,
            c.text_diff,
            None if same_diff else c.token_ids_diff,
            self._metrics(sent, i, c.request_perf_metrics),
            _tail(sent, (i, "logprobs"), c.logprobs),
            c.cumulative_logprob,
            c.prompt_logprobs,
        )

    @staticmethod
    def _metrics(sent: _Sent, i: int, m: RequestPerfMetrics | None) -> Wire | None:
        if m is None:
            return None
        t, s, kv = m.timing_metrics, m.speculative_decoding, m.kv_cache_metrics
        timing = (_us(t.arrival_time), _us(t.first_scheduled_time), _us(t.first_token_time),
                  _us(t.last_token_time))  # fmt: skip
        spec = (s.acceptance_rate, s.total_accepted_draft_tokens, s.total_draft_tokens,
                _tail(sent, (i, "acceptance_lengths"), s.acceptance_lengths), s.mean_acceptance_length,
                s.num_rounds, s.total_overturned_draft_tokens, _tail(sent, (i, "tree_budgets"), s.tree_budgets))  # fmt: skip
        kv_wire = None
        if kv is not None:
            kv_wire = (kv.num_total_allocated_blocks, kv.num_new_allocated_blocks, kv.num_reused_blocks,
                       kv.num_missed_blocks, kv.kv_cache_hit_rate)  # fmt: skip
        return timing, spec, kv_wire


class OutputDecoder:
    """The parent's side: `decode(wire)` -> (key, the RequestOutput the child encoded)."""

    def __init__(self) -> None:
        self._sent: dict[int, _Sent] = {}

    def decode(self, wire: Wire) -> tuple[int, RequestOutput]:
        key, request_id, prompt, comps, finished, error, cached = wire
        sent = self._sent.get(key)
        if sent is None:
            sent = self._sent[key] = _Sent()
        if prompt is not None:
            sent.prompt = prompt
        assert sent.prompt is not None, "a request's first output carries its prompt"
        text, ids = sent.prompt
        outputs = [self._completion(sent, c) for c in comps]
        if finished:
            del self._sent[key]
        return key, RequestOutput(request_id, text, ids, outputs, finished, error, cached)

    def forget(self, key: int) -> None:
        """Drop what is kept for request `key` (its outputs stopped coming: it failed here)."""
        self._sent.pop(key, None)

    def _completion(self, sent: _Sent, wire: Wire) -> CompletionOutput:
        i, text, ids, finish, stop, text_diff, ids_diff, metrics, logprobs, cumulative, prompt_rows = wire
        token_ids = _grown(sent, (i, "token_ids"), ids)
        return CompletionOutput(
            index=i,
            text=_grown(sent, (i, "text"), text),
            token_ids=token_ids,
            finish_reason=finish,
            stop_reason=stop,
            text_diff=text_diff,
            # the new ids sent once: a copy only where they are token_ids itself (sent whole)
            token_ids_diff=ids_diff if ids_diff is not None else ids[1] if ids[0] else list(ids[1]),
            request_perf_metrics=self._metrics(sent, i, metrics),
            logprobs=_grown(sent, (i, "logprobs"), logprobs),
            cumulative_logprob=cumulative,
            prompt_logprobs=prompt_rows,
        )

    @staticmethod
    def _metrics(sent: _Sent, i: int, wire: Wire | None) -> RequestPerfMetrics | None:
        if wire is None:
            return None
        timing, spec, kv = wire
        rate, accepted, drafted, lengths, mean, rounds, overturned, budgets = spec
        lengths = _grown(sent, (i, "acceptance_lengths"), lengths)
        budgets = _grown(sent, (i, "tree_budgets"), budgets)
        return RequestPerfMetrics(
            timing_metrics=TimingMetrics(_td(timing[0]), _td(timing[1]), _td(timing[2]), _td(timing[3])),  # type: ignore[arg-type]
            speculative_decoding=SpeculativeDecodingMetrics(
                rate, accepted, drafted, lengths, mean, rounds, overturned, budgets
            ),
            kv_cache_metrics=None if kv is None else KvCacheMetrics(*kv),
        )
