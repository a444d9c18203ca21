# SPDX-License-Identifier: Apache-2.0
"""The warm-up: throwaway batches run to completion before real traffic, so that what is built on
first use (the compiled round of every shape class the planner may choose, batch 1 and larger, greedy
and sampled, across page-width growth; the compiled prefill) is ready.

The batches (`variants`): greedy and sampled, at batch 2 and 1 (a batch of one has a compiled round
of its own), at every (draft length, DDTree budget) the planner may choose for that batch
(`RoundPlanner.shapes`). The longest draft length comes first, then the shorter ones longest first: a
background compiler (engine/precompile.py) delivers the classes serving uses most first. The prefill
of a batch size is compiled in that size's last batch (before it, prompts are prefilled eagerly unless
the prefill is already compiled).

Several processes may share the batches (engine/precompile.py): each runs batch n only if claim(n) is
true, and compiles only that batch's classes (`Executor.claim`).

When every class is already saved (a warm start), each batch stops after its first round: loading a
class and checking its guards takes one call, and the rest of the 48 tokens only cost time (smollm2's
16 batches took 22.7 s of a 34 s serve start, 4-7 s with one round each, loading included:
bench/README.md, "Warm start"). A class whose saved guards refuse that round is compiled again there,
before ready, as in a cold warm-up.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from dflash_trt.engine.compile import PREFILL, RoundCache
from dflash_trt.engine.config import PAGE_SIZE
from dflash_trt.engine.request import RequestParams
from dflash_trt.engine.round import RoundShape, round_flags

if TYPE_CHECKING:
    from dflash_trt.engine.engine import LLMEngine

log = logging.getLogger(__name__)

WARM_UP_BATCHES = (2, 1)  # batch sizes of the warm-up (a batch of one has a compiled round of its own)


class WarmUp(NamedTuple):
    """One throwaway batch of the warm-up: its round shape, batch size and request parameters."""

    g: int  # draft length
    budget: int  # DDTree budget
    mode: str  # "greedy" or "sampled"
    batch: int
    params: RequestParams


def variants(engine: LLMEngine) -> list[WarmUp]:
    """The warm-up's throwaway batches, in the order they run (module docstring)."""
    new_tokens = min(3 * PAGE_SIZE, engine.config.max_seq_len - 2)
    if new_tokens < 1:
        return []
    greedy = RequestParams(max_tokens=new_tokens, ignore_eos=True)
    sampled = RequestParams(max_tokens=new_tokens, ignore_eos=True, temperature=1.0, seed=0)
    batches = [bs for bs in WARM_UP_BATCHES if bs <= engine.config.max_batch_size]
    shapes = {bs: engine.planner.shapes(bs) for bs in batches}  # the longest draft first
    lens = {bs: list(dict.fromkeys(g for g, _ in shapes[bs])) for bs in batches}
    rank = {(bs, g): 0 if g == lens[bs][0] else 1 + i for bs in batches for i, g in enumerate(lens[bs])}
    every = sorted({s for bs in batches for s in shapes[bs]}, key=lambda s: (-s[0], s[1]))
    out = [
        WarmUp(g, budget, mode, bs, params)
        for g, budget in every
        for mode, params in (("greedy", greedy), ("sampled", sampled))
        for bs in batches
        if (g, budget) in shapes[bs]
    ]
    return sorted(out, key=lambda w: rank[w.batch, w.g])  # stable: the order above within a rank


def variant_classes(engine: LLMEngine, batches: list[WarmUp]) -> list[list[tuple[Any, ...]]]:
    """The compiled classes each warm-up batch compiles: its round's, and the prefill's where it is the
    last batch of its size."""
    out = []
    for n, w in enumerate(batches):
        req = engine.admission.make_request([1, 1], w.params)
        shape = RoundShape(w.g, w.budget, round_flags([req] * w.batch))
        keys = [RoundCache.class_key(shape.kwargs(), w.batch == 1)]
        if compiles_prefill(batches, n):
            keys.append(RoundCache.class_key({}, w.batch == 1, PREFILL))
        out.append(keys)
    return out


def classes(engine: LLMEngine) -> list[tuple[Any, ...]]:
    """Every compiled class the warm-up makes, without repeats, in the order it makes them."""
    found: list[tuple[Any, ...]] = []
    for keys in variant_classes(engine, variants(engine)):
        found += [k for k in keys if k not in found]
    return found


def compiles_prefill(batches: list[WarmUp], n: int) -> bool:
    """Whether batch `n` compiles the prefill of its batch size: the last batch of each size does."""
    return all(w.batch != batches[n].batch for w in batches[n + 1 :])


def run(engine: LLMEngine, claim: Callable[[int], bool] | None = None) -> float:
    """Run the warm-up's batches (those `claim` grants, when given). Returns the seconds it took.
    Engine thread, before serving."""
    t0 = time.perf_counter()
    batches = variants(engine)
    executor, planner = engine.executor, engine.planner
    owned = variant_classes(engine, batches) if claim is not None else []
    brief = claim is None and executor.on_disk(classes(engine))
    try:
        for n, w in enumerate(batches):
            if claim is not None:
                if not claim(n):
                    continue
                executor.claim(set(owned[n]))
            t1 = time.perf_counter()
            executor.compile_prefill = compiles_prefill(batches, n)
            planner.pin(w.g, w.budget)
            reqs = [
                engine.add_request([1 + i % max(1, engine.vocab_size - 1)] * 2, w.params)
                for i in range(w.batch)
            ]
            _run_batch(engine, reqs, brief)
            log.info("warm-up %d/%d (%s, batch %d, draft length %d%s): %.1f s", n + 1, len(batches), w.mode,
                     w.batch, w.g, f", tree budget {w.budget}" if planner.trees else "",
                     time.perf_counter() - t1)  # fmt: skip
    finally:
        executor.claim(None)
        executor.compile_prefill = True
        planner.unpin()
        planner.reset()  # warm-up rounds compile: their costs would mislead the choice
    return time.perf_counter() - t0


def _run_batch(engine: LLMEngine, reqs: list[Any], brief: bool) -> None:
    """Step until the batch is done; `brief`: cancel it after its first decode round."""
    rounds = engine.runner.times.rounds
    while engine.has_work():
        engine.step()
        if brief and engine.runner.times.rounds > rounds:
            brief = False
            for req in reqs:
                engine.abort(req.request_id)
