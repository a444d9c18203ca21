# SPDX-License-Identifier: Apache-2.0
"""The embedded serving engine: queue requests, then step. Built by `engine/assemble.py`.

Each `step()`:
  1. applies what other threads queued since the last step (new requests, aborts);
  2. schedule: `Scheduler.schedule()` admits waiting requests and picks the prefill chunks and the
     requests that run a round;
  3. prefill the chunks (`ModelRunner.prefill`);
  4. plan: the round's shape (`RoundPlanner.plan`: draft length and DDTree budget, pinned or chosen by
     measured cost for the batch size);
  5. execute: one round for every running request (`ModelRunner.launch_round`: RoundInputs built once,
     run by the executor); every request accepts its own number of drafts; the planner records the
     round's cost;
  6. commit: each request's tokens go through its stop rules (`postprocess.py`); finished requests'
     pages and rows go back to the scheduler.

Overlap: a runner whose rounds run asynchronously (`runner.overlaps`: today the stand-in's simulated
device, engine/stand_in.py) has round N+1 launched before round N is committed, as TensorRT-LLM's
overlap scheduler does (on by default in its PyTorch backend, DFlash included): the step collects and
commits round N while N+1 runs, and the LLM delivers N's outputs meanwhile. A request that round N
finishes has its round N+1 result dropped; such a runner must not need its pages after its end.
`ModelRunner` computes a round on the engine thread (`overlaps = False`): launch, collect and commit
follow each other, so an output is never a round late.

Threading: `add_request` and `abort` may be called from any thread (they only read immutable
state and put work on thread-safe queues); everything else runs on one engine thread.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from dflash_trt.engine import warmup
from dflash_trt.engine.admission import Admission
from dflash_trt.engine.config import PAGE_SIZE, EngineConfig
from dflash_trt.engine.postprocess import StepUpdate, commit_tokens
from dflash_trt.engine.request import Request, RequestParams
from dflash_trt.engine.runner import ModelRunner, Prefilled

if TYPE_CHECKING:
    from dflash_trt.engine.executor import Executor
    from dflash_trt.engine.planner import NullPlanner
    from dflash_trt.engine.round import RoundOutput, RoundParts, RoundShape
    from dflash_trt.engine.scheduler import Scheduler
    from dflash_trt.engine.stand_in import StandInRunner
    from dflash_trt.spec.decoding_config import DFlashDecodingConfig

log = logging.getLogger(__name__)


class Launched(NamedTuple):
    """A round launched and not yet committed: its requests, shape, launch time and result."""

    reqs: list[Request]
    shape: RoundShape
    t0: float
    result: Callable[[], RoundOutput]  # waits for the round when it still runs


class LLMEngine:
    def __init__(self, *, config: EngineConfig, tokenizer: Any | None, parts: RoundParts, executor: Executor,
                 planner: NullPlanner, scheduler: Scheduler, spec: DFlashDecodingConfig | None,
                 eos_token_ids: tuple[int, ...], num_kv_pages: int, packed_weights: int = 0,
                 paged_attention: int = 0) -> None:  # fmt: skip
        """The finished parts (engine/assemble.py `build_engine` makes them)."""
        self.config, self.tokenizer, self.spec = config, tokenizer, spec
        self.parts, self.executor, self.planner, self.scheduler = parts, executor, planner, scheduler
        # the stand-in of the serving path's benchmark may replace it (engine/stand_in.py)
        self.runner: ModelRunner | StandInRunner = ModelRunner(parts, executor)
        self.device = parts.device
        self.vocab_size = parts.target.config.vocab_size
        self.eos_token_ids = eos_token_ids
        self.num_kv_pages = num_kv_pages  # page 0 is the padding page
        self.packed_weights, self.paged_attention = packed_weights, paged_attention
        self.admission = Admission(config, vocab_size=self.vocab_size, eos_token_ids=eos_token_ids,
                                   tokenizer=tokenizer, kv_pages=num_kv_pages, pages_needed=scheduler.pages_needed,
                                   scratch_tokens=scheduler.scratch_tokens)  # fmt: skip
        self.clock = (
            time.perf_counter
        )  # times rounds for the planner's cost policies (tests inject their own)
        self._compiled_seen = 0  # compiled rounds in use at the latest round (see _round)
        self._new: queue.SimpleQueue[Request] = queue.SimpleQueue()  # from add_request
        self._aborts: queue.SimpleQueue[int] = queue.SimpleQueue()  # from abort
        self._live: dict[int, Request] = {}  # every request added and not yet finished
        self._in_flight: Launched | None = None  # an overlapping runner's round, launched, not committed
        self.num_steps = 0

    @property
    def target(self) -> Any:
        return self.parts.target

    @property
    def drafter(self) -> Any:
        return self.parts.drafter

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_pages * PAGE_SIZE

    # --- requests (any thread) ------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: RequestParams, *, owner: Any = None) -> Request:
        """Validate (engine/admission.py: the one place a request is checked) and queue a request.
        Raises RequestError naming the field, the value and the fix. Thread-safe."""
        req = self.admission.admit(prompt_ids, params, owner=owner)
        self._new.put(req)
        return req

    def abort(self, request_id: int) -> None:
        """Cancel a request at the next step: it ends with finish_reason 'cancelled'. Thread-safe;
        a request that already finished is left alone."""
        self._aborts.put(request_id)

    def has_work(self) -> bool:
        return (self.scheduler.has_work() or self._in_flight is not None or not self._new.empty()
                or not self._aborts.empty())  # fmt: skip

    # --- warm-up (engine thread, before serving) ------------------------------------------------------
    def warm_up(self, claim: Callable[[int], bool] | None = None) -> float:
        """Run the warm-up's throwaway batches (engine/warmup.py). Returns the seconds it took."""
        return warmup.run(self, claim)

    def warm_up_classes(self) -> list[tuple[Any, ...]]:
        """The compiled classes `warm_up` makes: its rounds' shape classes and the prefill's."""
        return warmup.classes(self)

    def warm_up_size(self) -> int:
        """How many throwaway batches `warm_up` runs (the most processes worth compiling them)."""
        return len(warmup.variants(self))

    # --- the step (engine thread) -----------------------------------------------------------------
    def step(self) -> list[StepUpdate]:
        updates = self._take_queued()
        batch = self.scheduler.schedule()
        if batch.prefill:
            firsts = self.runner.prefill(batch.prefill, batch.chunks)
            updates.extend(self._start(batch.prefill, batch.chunks, firsts))
        launched = self._launch(batch.decode) if batch.decode else None
        if self._in_flight is not None:  # an overlapping runner's round N, committed while N+1 runs
            updates.extend(self._commit_round(self._in_flight))
        if launched is not None and not self.runner.overlaps:
            updates.extend(self._commit_round(launched))
            launched = None
        self._in_flight = launched
        self.num_steps += 1
        return updates

    def _start(
        self, reqs: list[Request], chunks: list[tuple[int, int]], firsts: Prefilled
    ) -> list[StepUpdate]:
        """Prefilled chunks: a request whose prompt is complete starts decoding with its first token, and
        so do the siblings it was forked into (n > 1)."""
        for req, (_, hi) in zip(reqs, chunks):
            req.prefilled = hi
        started = [(r, t, lp) for r, t, lp in zip(reqs, firsts.tokens, firsts.logprobs) if t is not None]
        now = time.perf_counter()
        updates: list[StepUpdate] = []
        for req, tok, lp in [*started, *firsts.forked]:
            self.scheduler.prompt_done(req)
            if req.max_len == len(req.prompt_ids):  # max_tokens = 0: the prompt was only to be scored
                updates.extend(self._update(r, [], "") for r in self._finish(req, "length"))
                continue
            self.scheduler.start_decoding(req)
            req.first_token_time = req.last_token_time = now
            updates.append(self._postprocess(req, [tok], first=True, logprobs=None if lp is None else [lp]))
        return updates

    def _launch(self, reqs: list[Request]) -> Launched:
        """Plan the round and have the runner start it (a synchronous runner runs it whole here)."""
        self._forget_costs_on_new_compiled_rounds()
        shape = self.planner.plan(reqs)
        t0 = self.clock()
        return Launched(reqs, shape, t0, self.runner.launch_round(reqs, shape))

    def _commit_round(self, launched: Launched) -> list[StepUpdate]:
        """Wait for a launched round, time it for the planner and commit each request's tokens; a
        request that ended while the round was in flight (cancelled, or finished by the round before)
        is left alone."""
        reqs, shape, t0, result = launched
        out = result()
        self.planner.record(shape, len(reqs), self.clock() - t0, out)
        now, updates = time.perf_counter(), []
        for i, req in enumerate(reqs):
            if req.finished:
                continue
            a = out.accepted[i]
            req.num_draft_tokens += out.drafted[i]
            req.num_overturned_draft_tokens += out.overturned[i]
            req.last_token_time = now
            if self.planner.trees:
                req.tree_budgets.append(shape.budget)
            lps = out.logprobs[i][: a + 1] if out.logprobs is not None and req.logprobs is not None else None
            updates.append(
                self._postprocess(req, [*out.drafts[i][:a], out.emitted[i]], accepted=a, logprobs=lps)
            )
        return updates

    def _forget_costs_on_new_compiled_rounds(self) -> None:
        """Round costs measured while some shape classes ran eagerly (a background compiler was still
        at work) do not hold once their compiled rounds are in use: the planner starts over."""
        count = self.executor.compiled_count
        if count != self._compiled_seen:
            self._compiled_seen = count
            self.planner.reset()

    def fail_all(self) -> list[StepUpdate]:
        """End every queued and running request with finish_reason 'error' (after an engine
        failure, or at shutdown): one final update each. Engine thread."""
        self._take_queued()
        self._in_flight = None  # its tokens are not committed: every request it held fails below
        updates: list[StepUpdate] = []
        for req in list(self._live.values()):
            if not req.finished:  # a sibling may have ended with its leader already
                updates.extend(self._update(r, [], "") for r in self._finish(req, "error"))
        return updates

    def _take_queued(self) -> list[StepUpdate]:
        while not self._new.empty():
            req = self._new.get()
            for member in req.group:
                self._live[member.request_id] = member
            self.scheduler.add(req)
        updates: list[StepUpdate] = []
        while not self._aborts.empty():
            aborted = self._live.get(self._aborts.get())
            if aborted is not None:
                updates.extend(self._update(r, [], "") for r in self._finish(aborted, "cancelled"))
        return updates

    def _postprocess(self, req: Request, new: list[int], *, first: bool = False, accepted: int = 0,
                     logprobs: list[Any] | None = None) -> StepUpdate:  # fmt: skip
        finish, stop_reason, tokens, text_delta = commit_tokens(req, new, tokenizer=self.tokenizer, first=first,
                                                                accepted=accepted)  # fmt: skip
        if req.guide is not None:
            req.guide.advance(tokens)
        if logprobs is not None:  # one per new token; the stop rules may have kept fewer
            req.token_logprobs.extend(logprobs)
            del req.token_logprobs[len(req.output_ids) :]
        if finish is not None:
            self._finish(req, finish, stop_reason)
        return self._update(req, tokens, text_delta)

    def _finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> list[Request]:
        """End `req`; a leader that ends before its prefill does ends the siblings waiting for it too
        (they have no prompt in the caches). Returns every request it ended."""
        ended = req.group
        for member in ended:
            member.finish_reason = reason
            member.stop_reason = stop_reason
            self.scheduler.finish(member)
            self._live.pop(member.request_id, None)
        req.siblings = []
        return ended

    @staticmethod
    def _update(req: Request, tokens: list[int], text_delta: str) -> StepUpdate:
        return StepUpdate(
            req=req,
            new_token_ids=tokens,
            text_delta=text_delta,
            num_tokens=len(req.output_ids),
            text_len=len(req.text),
            num_rounds=len(req.acceptance_lengths),
            num_draft_tokens=req.num_draft_tokens,
            num_accepted_draft_tokens=req.num_accepted_draft_tokens,
            num_overturned_draft_tokens=req.num_overturned_draft_tokens,
            finished=req.finished,
        )

    # --- stats ------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        t = self.runner.times
        sched = self.scheduler
        return {
            "waiting": len(sched.waiting) + self._new.qsize(),
            "active": sched.num_active,
            "peak_active": sched.peak_active,
            "steps": self.num_steps,
            "kv_free_tokens": sched.pages_available * PAGE_SIZE,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "rounds": t.rounds,
            "round_s": t.round_s,
            "draft_s": t.draft_s,
            "verify_s": t.verify_s,
            "accept_s": t.accept_s,
            "prefill_s": t.prefill_s,
            **self.planner.summary(),
            **(sched.cache.stats() if sched.cache is not None else {}),
        }
