# SPDX-License-Identifier: Apache-2.0
"""The stand-in engine: tokens at a set rate with no model cost, to measure the serving path in front
of the engine (docs/serving.md, "Measuring the serving path"; bench/serving_path.py).

`DFLASH_TRT_STAND_IN=K:MS[:overlap|:serial]` replaces the engine's model runner (engine/runner.py) with
`StandInRunner`: a prefill emits each complete prompt's first token at once, and every round emits K
tokens per running request and takes MS ms on a simulated device that runs one round at a time. With
`overlap` (the default) the engine launches round N+1 before it commits round N, as TensorRT-LLM's
overlap scheduler does on a GPU (engine/engine.py, "Overlap"): the host's work hides under the
device's MS ms as long as it takes less. With `serial` each round is committed before the next is
launched (TensorRT-LLM's `disable_overlap_scheduler=True`): every round costs MS ms plus the host's
work. Everything else stays real: the scheduler, the stop rules and the detokenizer of the engine,
the LLM API, the engine process and its pipes, the Triton stub, tritonserver and the OpenAI front.
The tokens cycle through printable token ids of the tokenizer (so detokenizing them is real work);
a round reports K - 1 drafts, all accepted, so the DFlash statistics read tau = K. No KV cache is
written, and no log-probabilities are reported. Honoured only with `DFLASH_TRT_TESTING=1`, ignored
with a warning otherwise; the LLM reads it once when it builds its engine (compiled rounds are then
skipped: nothing runs them).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dflash_trt.engine.faults import TESTING_ENV
from dflash_trt.engine.round import PhaseTimes, RoundOutput, RoundShape
from dflash_trt.engine.runner import Prefilled
from dflash_trt.errors import ConfigError

if TYPE_CHECKING:
    from dflash_trt.engine.engine import LLMEngine
    from dflash_trt.engine.request import Request

log = logging.getLogger(__name__)

STAND_IN_ENV = "DFLASH_TRT_STAND_IN"
MAX_TOKEN_IDS = 64  # distinct ids a stand-in cycles through


MODES = ("overlap", "serial")


@dataclass(frozen=True, slots=True)
class StandIn:
    tokens_per_round: int  # K: tokens each running request gets per round (K - 1 accepted drafts)
    round_ms: float  # how long a round takes on the simulated device (0: as fast as the host can go)
    overlap: bool = True  # the engine launches the next round before it commits this one


def stand_in_from_env(environ: Mapping[str, str] | None = None) -> StandIn | None:
    """The stand-in the environment asks for, or None. A malformed switch is a ConfigError when testing."""
    env = os.environ if environ is None else environ
    spec = env.get(STAND_IN_ENV, "").strip()
    if not spec:
        return None
    if env.get(TESTING_ENV) != "1":
        log.warning("%s=%r ignored: the stand-in engine needs %s=1", STAND_IN_ENV, spec, TESTING_ENV)
        return None
    k, ms, *mode = spec.split(":") if spec.count(":") in (1, 2) else ("", "")
    try:
        stand_in = StandIn(int(k), float(ms), mode in ([], [MODES[0]]))
    except ValueError:
        stand_in = StandIn(0, -1.0)
    if (
        stand_in.tokens_per_round < 1
        or not 0 <= stand_in.round_ms < 3_600_000
        or mode not in ([], *([m] for m in MODES))
    ):
        raise ConfigError(STAND_IN_ENV, spec, "is not TOKENS_PER_ROUND:ROUND_MS[:overlap|:serial] with "
                          "TOKENS_PER_ROUND >= 1 and ROUND_MS >= 0",
                          hint="e.g. 8:10 (8 tokens per request every 10 ms, rounds overlapped), or unset it")  # fmt: skip
    return stand_in


def printable_ids(tokenizer: Any | None, vocab_size: int, avoid: Iterable[int]) -> list[int]:
    """Up to MAX_TOKEN_IDS token ids that decode, alone, to visible ASCII text (none of `avoid` nor a
    special token); without a tokenizer, the first ids of the vocabulary not in `avoid`."""
    skip = set(avoid) | set(getattr(tokenizer, "all_special_ids", None) or ())
    ids: list[int] = []
    for i in range(vocab_size):
        if len(ids) == MAX_TOKEN_IDS:
            break
        if i in skip:
            continue
        text = None if tokenizer is None else tokenizer.decode([i], skip_special_tokens=False)
        if text is None or (text.isascii() and text.isprintable() and text.strip()):
            ids.append(i)
    if not ids:
        raise ConfigError(STAND_IN_ENV, "", f"finds no printable token among {vocab_size} ids",
                          hint="unset it: this tokenizer has nothing a stand-in can emit")  # fmt: skip
    return ids


class StandInRunner:
    """`ModelRunner`'s `prefill`, `launch_round` and `decode_round`, with no model behind them (module
    docstring). `overlaps` tells the engine whether to launch a round before it commits the last."""

    def __init__(self, stand_in: StandIn, token_ids: list[int], *, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.perf_counter) -> None:  # fmt: skip
        self.stand_in = stand_in
        self.overlaps = stand_in.overlap
        self.token_ids = token_ids
        self.times = PhaseTimes()
        self._sleep, self._clock = sleep, clock
        self._free_at = 0.0  # when the simulated device finishes the last round launched
        # per request of the last round launched: the output position its tokens end at. The engine
        # commits a round whole (or ends the request) before it launches the one after next, so a
        # request's next round starts there, or at its output when that round is committed already.
        self._ends: dict[int, int] = {}

    def _tokens(self, req: Request, n: int, base: int | None = None) -> list[int]:
        """The request's next n tokens: the cycle, at output position `base` (default: its output's end)."""
        base, ids = len(req.output_ids) if base is None else base, self.token_ids
        return [ids[(base + j) % len(ids)] for j in range(n)]

    def prefill(self, reqs: list[Request], chunks: list[tuple[int, int]]) -> Prefilled:
        """The first token of every prompt now complete (and of its siblings, n > 1), at no cost."""
        t0 = self._clock()
        tokens: list[int | None] = []
        forked = []
        for req, (_, hi) in zip(reqs, chunks):
            done = hi == len(req.prompt_ids)
            tokens.append(self._tokens(req, 1)[0] if done else None)
            if done:  # the leader's siblings start now, as after ModelRunner's cache copy
                siblings, req.siblings = req.group[1:], []
                for sib in siblings:
                    sib.prefilled = len(sib.prompt_ids)
                    forked.append((sib, self._tokens(sib, 1)[0], None))
        self.times.prefill_s += self._clock() - t0
        return Prefilled(tokens, [None] * len(reqs), tuple(forked))

    def launch_round(self, reqs: list[Request], shape: RoundShape) -> Callable[[], RoundOutput]:
        """K tokens per request (K - 1 accepted drafts, then the emitted one), ready ROUND_MS after the
        simulated device is free; the returned function waits for them."""
        start = max(self._clock(), self._free_at)
        k = self.stand_in.tokens_per_round
        bases = [max(len(req.output_ids), self._ends.get(req.request_id, 0)) for req in reqs]
        rows = [self._tokens(req, k, base) for req, base in zip(reqs, bases)]
        self._ends = {req.request_id: base + k for req, base in zip(reqs, bases)}
        out = RoundOutput(
            accepted=[k - 1] * len(reqs),
            emitted=[r[-1] for r in rows],
            drafts=[r[:-1] for r in rows],
            drafted=[k - 1] * len(reqs),
            path=[list(range(k)) for _ in reqs],
            overturned=[0] * len(reqs),
        )
        self._free_at = ready = start + self.stand_in.round_ms / 1000

        def result() -> RoundOutput:
            left = ready - self._clock()
            if left > 0:
                self._sleep(left)
            self.times.round_s += ready - start
            self.times.rounds += 1
            return out

        return result

    def decode_round(self, reqs: list[Request], shape: RoundShape) -> RoundOutput:
        """One round, launched and waited for."""
        return self.launch_round(reqs, shape)()


def install_from_env(engine: LLMEngine, environ: Mapping[str, str] | None = None) -> StandIn | None:
    """Replace the engine's model runner with a stand-in when the environment asks for one."""
    stand_in = stand_in_from_env(environ)
    if stand_in is None:
        return None
    ids = printable_ids(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    engine.runner = StandInRunner(stand_in, ids)
    log.warning("stand-in engine armed: %d tokens per request per %g ms round, rounds %s, no model cost (%s=1)",
                stand_in.tokens_per_round, stand_in.round_ms, MODES[not stand_in.overlap], TESTING_ENV)  # fmt: skip
    return stand_in
