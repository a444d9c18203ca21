# SPDX-License-Identifier: Apache-2.0
"""The embedded engine behind the LLM API: lossless continuous batching, streaming, cancellation,
admission control, per-request errors, and a dead or wedged engine (float32 CPU)."""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading
import time

import pytest
import torch

from dflash_trt import LLM, DFlashDecodingConfig, SamplingParams
from dflash_trt.engine.runner import pass_groups
from dflash_trt.errors import ConfigError, EngineDeadError, RequestError
from dflash_trt.models.checkpoint import load_drafter, save_drafter
from dflash_trt.reference.generate import spec_generate
from dflash_trt.reference.hf_target import HFTarget
from dflash_trt.spec.sampling import SamplingConfig
from tests.conftest import make_drafter, make_target

BLOCK = 6


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A small-vocabulary target and a drafter that it often agrees with (acceptance > 1)."""
    root = tmp_path_factory.mktemp("pair")
    target = make_target("qwen3", seed=31, vocab=13)
    target.save_pretrained(root / "target")
    save_drafter(make_drafter(target, block_size=BLOCK, seed=32, std=0.5), root / "drafter")
    return root / "target", root / "drafter", target


def spec(ddir, **kw):
    return {"decoding_type": "DFlash", "max_draft_len": BLOCK - 1, "speculative_model": str(ddir), **kw}


def reference(pair, prompt, sp: SamplingParams, block=BLOCK):
    """The batch-1 reference loop on the transformers target: the oracle for every request."""
    _, ddir, model = pair
    drafter = load_drafter(ddir)
    temperature = 0.0 if sp.temperature is None else sp.temperature
    cfg = SamplingConfig(temperature=temperature, top_k=sp.top_k or 0, top_p=sp.top_p or 1.0, seed=sp.seed)
    return spec_generate(
        HFTarget(model), drafter, prompt, max_new_tokens=sp.max_tokens, sampling=cfg, block_size=block
    )


def workload(n: int, seed: int = 0) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(12) for _ in range(rng.randint(1, 30))]
        kind = i % 4
        if kind == 0:
            sp = SamplingParams(max_tokens=rng.randint(3, 40))
        elif kind == 1:
            sp = SamplingParams(max_tokens=rng.randint(3, 40), temperature=0.8, seed=1000 + i)
        elif kind == 2:
            sp = SamplingParams(
                max_tokens=rng.randint(3, 40), temperature=1.2, top_k=4, top_p=0.9, seed=2000 + i
            )
        else:
            sp = SamplingParams(max_tokens=rng.randint(3, 40), temperature=0.0, seed=i)
        out.append((prompt, sp))
    return out


@pytest.mark.parametrize("static_rounds", [False, True], ids=["eager", "static-padded"])
def test_concurrent_requests_equal_single_request_reference(pair, static_rounds):
    """Dozens of concurrent requests with different lengths and parameters: every request gets
    exactly the tokens (and per-round acceptance) of the batch-1 reference loop."""
    tdir, ddir, _ = pair
    jobs = workload(28)
    llm = LLM(str(tdir), speculative_config=spec(ddir), max_batch_size=8, max_num_tokens=64, max_seq_len=128)
    if static_rounds:  # padded static buffers: the exact path a CUDA graph would capture
        llm.engine.executor.static_rounds = True
        llm.engine.executor.graph_batch_sizes = (3, 8)
    try:
        handles = [llm.generate_async(p, sp, streaming=bool(i % 2)) for i, (p, sp) in enumerate(jobs)]
        results = [h.result(timeout=120) for h in handles]
        stats = llm.get_stats()
    finally:
        llm.shutdown()
    accepted = 0
    for (prompt, sp), res in zip(jobs, results):
        ref = reference(pair, prompt, sp)
        out = res.outputs[0]
        assert out.token_ids == ref.output_ids, (prompt, sp)
        assert out.finish_reason == "length"
        accepted += sum(ref.acceptance_lengths) - len(ref.acceptance_lengths)
    assert accepted > 20, "drafts were rarely accepted: the comparison has no teeth"
    assert stats["peak_active"] == 8 and stats["active"] == 0 and stats["waiting"] == 0
    assert stats["kv_free_tokens"] == stats["kv_capacity_tokens"]


def test_speculative_stats_match_reference(pair):
    tdir, ddir, _ = pair
    with LLM(str(tdir), speculative_config=spec(ddir), max_batch_size=4, max_seq_len=128) as llm:
        jobs = workload(6, seed=3)
        res = llm.generate(
            [p for p, _ in jobs],
            [SamplingParams(**{**vars(sp), "return_perf_metrics": True}) for _, sp in jobs],
        )
    for (prompt, sp), r in zip(jobs, res):
        ref = reference(pair, prompt, sp)
        m = r.outputs[0].request_perf_metrics.speculative_decoding
        assert m.acceptance_lengths == ref.acceptance_lengths
        assert m.num_rounds == ref.num_rounds
        assert m.total_accepted_draft_tokens == ref.num_accepted_draft_tokens
        assert m.total_draft_tokens >= m.total_accepted_draft_tokens
        assert m.mean_acceptance_length == pytest.approx(ref.mean_acceptance_length)
        timing = r.outputs[0].request_perf_metrics.timing_metrics
        assert (
            timing.arrival_time
            <= timing.first_scheduled_time
            <= timing.first_token_time
            <= timing.last_token_time
        )


def test_plain_engine_equals_speculative_engine(pair):
    tdir, ddir, _ = pair
    jobs = [(p, sp) for p, sp in workload(12, seed=5) if sp.temperature in (None, 0.0)]
    with LLM(str(tdir), max_batch_size=5, max_seq_len=128) as plain:
        a = plain.generate([p for p, _ in jobs], [sp for _, sp in jobs])
    with LLM(str(tdir), speculative_config=spec(ddir), max_batch_size=5, max_seq_len=128) as llm:
        b = llm.generate([p for p, _ in jobs], [sp for _, sp in jobs])
    assert [r.outputs[0].token_ids for r in a] == [r.outputs[0].token_ids for r in b]


def test_schedule_turns_speculation_off_under_load(pair):
    tdir, ddir, _ = pair
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
    sp = SamplingParams(max_tokens=20, return_perf_metrics=True)
    with LLM(
        str(tdir), speculative_config=spec(ddir, max_concurrency=1), max_batch_size=4, max_seq_len=64
    ) as llm:
        res = llm.generate(prompts, sp)
    for p, r in zip(prompts, res):
        m = r.outputs[0].request_perf_metrics.speculative_decoding
        assert m.total_draft_tokens == 0  # four in lockstep > max_concurrency: plain decoding
        assert r.outputs[0].token_ids == reference(pair, p, sp).output_ids
    with LLM(
        str(tdir), speculative_config=spec(ddir, draft_len_schedule={2: 5, 4: 2}), max_batch_size=4
    ) as llm:
        res = llm.generate(prompts, sp)
    for p, r in zip(prompts, res):
        m = r.outputs[0].request_perf_metrics.speculative_decoding
        assert max(m.acceptance_lengths) <= 3  # draft length 2 at batch 4
        assert r.outputs[0].token_ids == reference(pair, p, sp).output_ids


def test_draft_len_schedule_semantics():
    c = DFlashDecodingConfig.from_any(
        {"decoding_type": "DFlash", "max_draft_len": 4, "draft_len_schedule": {8: 2, 4: 4, 32: 1}}
    )
    assert [c.draft_len_for(n) for n in (1, 4, 5, 8, 9, 32, 33)] == [4, 4, 2, 2, 1, 1, 0]
    m = DFlashDecodingConfig.from_any({"decoding_type": "DFlash", "max_draft_len": 3, "max_concurrency": 2})
    assert [m.draft_len_for(n) for n in (1, 2, 3)] == [3, 3, 0]
    bad = [
        ({"max_draft_len": 0}, r"max_draft_len=0: must be an integer > 0"),
        ({"max_draft_len": 4, "draft_len_schedule": {4: 3}}, r"value at the smallest batch size must equal"),
        ({"max_draft_len": 4, "draft_len_schedule": {4: 4, 8: 5}}, r"draft_len_schedule\[8\]=5"),
        ({"max_draft_len": 4, "max_concurrency": 2, "draft_len_schedule": {2: 4}}, r"mutually exclusive"),
        ({"max_draft_len": 4, "decoding_type": "Eagle3"}, r"decoding_type='Eagle3'"),
        (
            {"max_draft_len": 4, "num_nextn": 1},
            r"speculative_config.num_nextn=1: is not a DFlashDecodingConfig field",
        ),
    ]
    for fields, pattern in bad:
        with pytest.raises(ConfigError, match=pattern):
            DFlashDecodingConfig.from_any({"decoding_type": "DFlash", **fields})


def test_max_draft_len_beyond_block_is_refused(pair):
    tdir, ddir, _ = pair
    with pytest.raises(ConfigError, match=r"max_draft_len=6: exceeds the drafter's block_size - 1 = 5"):
        LLM(str(tdir), speculative_config=spec(ddir, max_draft_len=6))
    with pytest.raises(TypeError, match=r"unsupported argument 'enable_chunked_prefill'"):
        LLM(str(tdir), enable_chunked_prefill=True)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2"):
        LLM(str(tdir), tensor_parallel_size=2)


def test_streaming_deltas_concatenate_to_final_output():
    async def run():
        with LLM(
            "tiny",
            speculative_config={"decoding_type": "DFlash", "max_draft_len": 7, "speculative_model": "tiny"},
        ) as llm:
            prompts = ["def add(a, b):\n", "import os\n", "x = [1, 2, 3]\n", "class A:\n"]
            handles = [
                llm.generate_async(
                    p,
                    SamplingParams(max_tokens=48, ignore_eos=True, temperature=0.7 * (i % 2), seed=i),
                    streaming=True,
                )
                for i, p in enumerate(prompts)
            ]

            async def collect(h):
                text, ids, chunks = "", [], 0
                async for item in h:
                    text += item.outputs[0].text_diff
                    ids += item.outputs[0].token_ids_diff
                    chunks += 1
                    last = item
                return text, ids, chunks, last

            return await asyncio.gather(*(collect(h) for h in handles))

    for text, ids, chunks, last in asyncio.run(run()):
        assert last.finished and chunks >= 2
        assert text == last.outputs[0].text
        assert ids == last.outputs[0].token_ids and len(ids) == 48


def test_a_streaming_consumer_that_falls_behind_gets_the_missed_outputs_as_one():
    """GenerationHandle's async iteration: outputs that arrived while the consumer was busy come as one
    (the latest snapshot, the diffs concatenated); a finished output is never merged past; sync
    iteration still yields every output."""
    from dflash_trt.api.handle import GenerationHandle
    from dflash_trt.api.outputs import CompletionOutput, RequestOutput

    words = ["def", " f", "(x", "):", "\n", "  return", " x"]

    def out(n: int, finished: bool = False) -> RequestOutput:
        comp = CompletionOutput(index=0, text="".join(words[:n]), token_ids=list(range(n)),
                                finish_reason="length" if finished else None, text_diff=words[n - 1],
                                token_ids_diff=[n - 1])  # fmt: skip
        return RequestOutput(
            request_id=7, prompt="p", prompt_token_ids=[1], outputs=[comp], finished=finished
        )

    def handle() -> GenerationHandle:
        return GenerationHandle(prompt="p", prompt_ids=[1], sampling_params=SamplingParams(), streaming=True,
                                on_abort=lambda h: None)  # fmt: skip

    async def run() -> list[RequestOutput]:
        h = handle()  # bound to this loop: pushes queue here
        got = []
        h.push(out(1))
        h.push(out(2))
        h.push(out(3))
        async for item in h:  # three outputs waiting: one item; then one per push
            got.append(item)
            if len(got) == 1:
                h.push(out(4))
            elif len(got) == 2:
                h.push(out(5))
                h.push(out(6))
                h.push(out(7, finished=True))
                h.push(out(7, finished=True))  # ignored: the request already finished
        return got

    got = asyncio.run(run())
    assert [len(i.outputs[0].token_ids) for i in got] == [3, 4, 7]
    assert [i.outputs[0].text_diff for i in got] == ["def f(x", "):", "\n  return x"]
    assert [i.outputs[0].token_ids_diff for i in got] == [[0, 1, 2], [3], [4, 5, 6]]
    assert got[-1].finished and got[-1].outputs[0].finish_reason == "length"
    assert "".join(i.outputs[0].text_diff for i in got) == got[-1].outputs[0].text
    h = handle()
    for n in range(1, 8):
        h.push(out(n, finished=n == 7))
    assert [i.outputs[0].text_diff for i in h] == words  # sync iteration: every output, unmerged


def test_a_steps_outputs_wake_each_consumer_loop_once():
    """Outputs pushed with a `Wakes` reach their async consumers in order, through one callback per
    event loop for the whole step, and only once `send` runs."""
    import threading

    from dflash_trt.api.handle import GenerationHandle, Wakes
    from dflash_trt.api.outputs import CompletionOutput, RequestOutput

    def out(rid: int, n: int) -> RequestOutput:
        comp = CompletionOutput(
            index=0, text="x" * n, token_ids=list(range(n)), text_diff="x", token_ids_diff=[n - 1]
        )
        return RequestOutput(
            request_id=rid, prompt="p", prompt_token_ids=[1], outputs=[comp], finished=n == 3
        )

    async def run() -> tuple[list[list[int]], list[str]]:
        loop = asyncio.get_running_loop()
        calls: list[str] = []  # the callbacks other threads scheduled on this loop
        real = loop.call_soon_threadsafe

        def counted(*args):
            calls.append(getattr(args[0], "__name__", "?"))
            return real(*args)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        handles = [GenerationHandle(prompt="p", prompt_ids=[1], sampling_params=SamplingParams(), streaming=True,
                                    on_abort=lambda h: None) for _ in range(2)]  # fmt: skip
        for h in handles:
            h._bind(loop)

        def engine_step(n: int) -> None:  # another thread, as the engine's or the pipe reader's
            wakes = Wakes()
            for rid, h in enumerate(handles):
                h.push(out(rid, n), wakes)
            assert all(h._aqueue.empty() for h in handles)  # nothing queued before send
            wakes.send()

        async def consume(h: GenerationHandle) -> list[int]:
            return [len(item.outputs[0].token_ids) async for item in h]

        tasks = [asyncio.ensure_future(consume(h)) for h in handles]
        for n in (1, 2, 3):
            worker = threading.Thread(target=engine_step, args=(n,))
            worker.start()
            await asyncio.to_thread(worker.join)
            await asyncio.sleep(0)  # let the consumers take this step's outputs before the next
        return [await t for t in tasks], calls

    lengths, calls = asyncio.run(run())
    assert lengths == [[1, 2, 3], [1, 2, 3]]
    assert calls.count("_put_all") == 3 and "put_nowait" not in calls, calls  # one wake-up per step


def test_sync_streaming_and_non_streaming_agree():
    with LLM(
        "tiny",
        speculative_config={"decoding_type": "DFlash", "max_draft_len": 7, "speculative_model": "tiny"},
    ) as llm:
        sp = SamplingParams(max_tokens=30, ignore_eos=True)
        h = llm.generate_async("for i in range(", sp, streaming=True)
        items = list(h)
        final = llm.generate("for i in range(", sp)
    assert "".join(i.outputs[0].text_diff for i in items) == final.outputs[0].text
    assert items[-1].outputs[0].token_ids == final.outputs[0].token_ids


def test_cancellation_frees_the_slot(pair):
    tdir, ddir, _ = pair
    with LLM(str(tdir), speculative_config=spec(ddir), max_batch_size=1, max_seq_len=2000) as llm:
        long = llm.generate_async([1, 2, 3], SamplingParams(max_tokens=1900, ignore_eos=True), streaming=True)
        queued = llm.generate_async([4, 5], SamplingParams(max_tokens=10))
        it = iter(long)
        first = next(it)
        assert not first.finished
        long.abort()
        rest = list(it)
        assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "cancelled"
        assert len(rest[-1].outputs[0].token_ids) < 1900
        done = queued.result(timeout=60)  # the freed slot serves the queued request
        assert done.outputs[0].finish_reason == "length"
        time.sleep(0.05)
        stats = llm.get_stats()
        assert stats["active"] == 0 and stats["kv_free_tokens"] == stats["kv_capacity_tokens"]


def _collect(handle, into: dict, key) -> None:
    """Iterate `handle` to its end; record the outputs and how it ended (the exception, or None)."""
    items: list = []
    try:
        for item in handle:
            items.append(item)
        into[key] = (items, None)
    except Exception as exc:
        into[key] = (items, exc)


@pytest.mark.parametrize(
    ("fault", "cause"),
    [("engine-raise:30", r"engine failure: InjectedFault: injected engine-raise at step 30"),
     ("engine-hang:30", r"engine wedged for \d+ s: no step finished while \d+ requests were pending")],
    ids=["raise", "hang"],
)  # fmt: skip
def test_a_dead_or_wedged_engine_fails_every_request_and_refuses_new_ones(pair, monkeypatch, fault, cause):
    tdir, ddir, _ = pair
    monkeypatch.setenv("DFLASH_TRT_TESTING", "1")
    monkeypatch.setenv("DFLASH_TRT_FAULT_INJECT", fault)
    with LLM(str(tdir), speculative_config=spec(ddir), max_batch_size=2, max_seq_len=2000,
             wedge_timeout_s=1.0) as llm:  # fmt: skip
        assert llm.engine_error is None
        sp = SamplingParams(max_tokens=1900, ignore_eos=True)
        # two run (streamed, sync and async consumers), two wait in the queue: all four are pending
        handles = [llm.generate_async([1, 2, 3], sp, streaming=True) for _ in range(2)]
        handles += [llm.generate_async([4, 5], sp) for _ in range(2)]
        ended: dict = {}
        threads = [threading.Thread(target=_collect, args=(h, ended, i)) for i, h in enumerate(handles[:3])]
        for t in threads:
            t.start()

        async def consume_async():
            try:
                await handles[3]
                return None
            except Exception as exc:
                return exc

        async_exc = asyncio.run(asyncio.wait_for(consume_async(), 60))
        for t in threads:
            t.join(60)
        assert isinstance(async_exc, EngineDeadError) and re.search(cause, str(async_exc)), async_exc
        for i in range(3):
            items, exc = ended[i]
            assert isinstance(exc, EngineDeadError) and re.search(cause, str(exc)), exc
            assert exc.output.finished and exc.output.outputs[0].finish_reason == "error"
            if items:  # what a stream had received is kept in the error's output
                assert exc.output.outputs[0].token_ids[: len(items[-1].outputs[0].token_ids)] == (
                    items[-1].outputs[0].token_ids
                )
        assert re.search(cause, llm.engine_error or ""), llm.engine_error
        with pytest.raises(EngineDeadError, match="the engine is dead: " + cause):
            llm.generate_async([1], SamplingParams(max_tokens=1))


def test_fault_switch_needs_the_testing_flag_and_a_valid_value(monkeypatch):
    from dflash_trt.engine.faults import Fault, fault_from_env

    assert fault_from_env({}) is None
    assert fault_from_env({"DFLASH_TRT_FAULT_INJECT": "engine-raise:3"}) is None  # ignored without the flag
    on = {"DFLASH_TRT_TESTING": "1"}
    assert fault_from_env({**on, "DFLASH_TRT_FAULT_INJECT": "engine-hang:12"}) == Fault("engine-hang", 12)
    for bad in ("engine-raise", "engine-raise:0", "engine-explode:2", "engine-hang:x"):
        with pytest.raises(ConfigError, match=r"DFLASH_TRT_FAULT_INJECT=.*engine-raise:N, engine-hang:N"):
            fault_from_env({**on, "DFLASH_TRT_FAULT_INJECT": bad})
    assert fault_from_env({**on, "DFLASH_TRT_FAULT_INJECT": "engine-slow:40"}) == Fault("engine-slow", 40)


def test_a_slow_engine_waits_before_every_step_and_stops_waiting_at_shutdown():
    from dflash_trt.engine.faults import Fault, with_fault

    class Released:  # the LLM's shutdown event, recording each wait instead of sleeping
        def __init__(self) -> None:
            self.waits: list[float] = []

        def wait(self, timeout: float | None = None) -> bool:
            self.waits.append(timeout)
            return False

    released, steps = Released(), []
    step = with_fault(lambda: steps.append(len(steps)) or len(steps), Fault("engine-slow", 40), released)
    assert [step() for _ in range(3)] == [1, 2, 3]  # every step runs, none raises
    assert released.waits == [0.04, 0.04, 0.04]


def test_watchdog_ignores_an_idle_engine_and_checks_its_setting(pair):
    tdir, _, _ = pair
    with LLM(str(tdir), max_batch_size=1, max_seq_len=64, wedge_timeout_s=0.2) as llm:
        time.sleep(1.0)  # parked, waiting for work: five timeouts pass without a wedge
        assert llm.engine_error is None
        assert llm.generate([1, 2], SamplingParams(max_tokens=2)).outputs[0].finish_reason == "length"
    for bad in (0, -1.0, "10", True):
        with pytest.raises(ConfigError, match=r"wedge_timeout_s=.*must be a number of seconds > 0, or None"):
            LLM(str(tdir), wedge_timeout_s=bad)


def test_handles_created_off_the_loop_stream_on_the_loop_that_iterates_them(pair):
    tdir, ddir, _ = pair
    with LLM(str(tdir), speculative_config=spec(ddir), max_batch_size=2, max_seq_len=256) as llm:
        sp = SamplingParams(max_tokens=20, ignore_eos=True)
        want = llm.generate([1, 2, 3], sp)

        async def main():
            # a server's pattern: tokenize and validate on a worker thread, stream on the loop
            handle = await asyncio.to_thread(llm.generate_async, [1, 2, 3], sp, True)
            return [item async for item in handle]

        items = asyncio.run(main())
        assert items[-1].finished and items[-1].outputs[0].token_ids == want.outputs[0].token_ids
        assert "".join(i.outputs[0].text_diff for i in items) == want.outputs[0].text


def test_shutdown_ends_every_request_explicitly(pair):
    tdir, ddir, _ = pair
    llm = LLM(str(tdir), speculative_config=spec(ddir), max_batch_size=1, max_seq_len=2000)
    running = llm.generate_async([1, 2, 3], SamplingParams(max_tokens=1900, ignore_eos=True), streaming=True)
    queued = llm.generate_async([4, 5], SamplingParams(max_tokens=1900, ignore_eos=True))
    next(iter(running))  # the first request is in flight
    llm.shutdown()
    for handle in (running, queued):
        with pytest.raises(EngineDeadError, match="the LLM was shut down") as info:
            handle.result(timeout=10)
        assert info.value.output.finished and info.value.output.outputs[0].finish_reason == "error"
    assert llm.engine_error is None  # a clean shutdown is not a death
    with pytest.raises(Exception, match="the LLM was shut down"):
        llm.generate_async([1], SamplingParams(max_tokens=1))


def test_overload_queues_and_kv_admission(pair):
    tdir, ddir, _ = pair
    # 4 pages of 16 tokens: each request reserves 3 pages, so only one runs at a time
    with LLM(str(tdir), speculative_config=spec(ddir), max_batch_size=4, max_seq_len=256,
             kv_cache_config={"max_tokens": 64}) as llm:  # fmt: skip
        res = llm.generate([[i % 12 + 1] * 8 for i in range(6)], SamplingParams(max_tokens=30))
        assert all(r.outputs[0].finish_reason == "length" for r in res)
        assert llm.get_stats()["peak_active"] == 1
        with pytest.raises(
            RequestError,
            match=r"needs 80 KV tokens \(prompt 20 \+ max_tokens 60\) but the whole cache holds 64",
        ):
            llm.generate([1] * 20, SamplingParams(max_tokens=60))
    with LLM(str(tdir), max_batch_size=2, max_seq_len=64) as llm:
        res = llm.generate([[3]] * 9, SamplingParams(max_tokens=10))
        assert len(res) == 9 and llm.get_stats()["peak_active"] == 2


@pytest.mark.parametrize(
    ("prompt", "kwargs", "pattern"),
    [
        ([1, 2], {"max_tokens": 0}, r"max_tokens=0 must be an integer >= 1"),
        ([1, 2], {"max_tokens": -5}, r"max_tokens=-5"),
        ([1, 2], {"top_p": 0.0, "temperature": 1.0}, r"top_p=0.0: must be in \(0, 1\]"),
        ([1, 2], {"top_p": 1.5}, r"top_p=1.5"),
        ([1, 2], {"temperature": -0.1}, r"temperature=-0.1: must be a finite number >= 0"),
        ([1] * 64, {"max_tokens": 1}, r"prompt has 64 tokens, not below max_seq_len=64"),
        (
            [1] * 40,
            {"max_tokens": 30},
            r"max_tokens=30: prompt \(40 tokens\) \+ max_tokens exceeds max_seq_len=64",
        ),
        ([], {}, r"prompt is empty"),
        ([1, 99], {}, r"prompt_ids\[1\]=99: out of range for vocab_size=13"),
        ([1], {"n": 3}, r"n=3: more sequences than the engine's max_batch_size=2"),
        ([1], {"n": 0}, r"n=0 must be an integer >= 1"),
        ([1], {"n": 2, "best_of": 1}, r"best_of=1 must be an integer >= n=2"),
        ([1], {"stop": "x"}, r"stop strings need a tokenizer"),
        (
            [1],
            {"stop_token_ids": [3, 1000000]},
            r"stop_token_ids\[1\]=1000000: out of range for vocab_size=13",
        ),
        ([1], {"stop_token_ids": [-3]}, r"stop_token_ids\[0\]=-3: out of range"),
        ([1], {"temperature": "hot"}, r"temperature='hot': must be a finite number"),
        ([1], {"top_k": 1.5, "temperature": 1.0}, r"top_k=1.5: must be an integer >= 0"),
        ([1], {"min_tokens": -1}, r"min_tokens=-1 must be an integer >= 0"),
        ([1], {"seed": -2}, r"seed=-2 must be an integer >= 0"),
        ({"prompt_token_ids": [1, 99]}, {}, r"prompt_ids\[1\]=99: out of range"),
        (
            {"prompt": "x", "prompt_token_ids": [1]},
            {},
            r"exactly one of 'prompt' \(text\) or 'prompt_token_ids'",
        ),
        ({"prompt": "x"}, {}, r"a text prompt needs a tokenizer"),
        (3.5, {}, r"prompt of type float is not a string, a list of token ids"),
    ],
)
def test_bad_requests_are_refused_and_the_engine_keeps_serving(pair, prompt, kwargs, pattern):
    tdir, ddir, _ = pair
    with LLM(str(tdir), speculative_config=spec(ddir), max_batch_size=2, max_seq_len=64) as llm:
        with pytest.raises(RequestError, match=pattern):
            llm.generate_async(prompt, SamplingParams(**kwargs))
        ok = llm.generate([1, 2, 3], SamplingParams(max_tokens=5))
        assert len(ok.outputs[0].token_ids) == 5


def test_stop_strings_stop_ids_and_min_tokens():
    with LLM(
        "tiny",
        speculative_config={"decoding_type": "DFlash", "max_draft_len": 7, "speculative_model": "tiny"},
    ) as llm:
        free = llm.generate("def f(x):\n", SamplingParams(max_tokens=60, ignore_eos=True)).outputs[0]
        stop = free.text[20:23]
        cut = free.text.find(stop)
        out = llm.generate(
            "def f(x):\n", SamplingParams(max_tokens=60, ignore_eos=True, stop=[stop, "\x00never"])
        ).outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == free.text[:cut]
        assert out.token_ids == free.token_ids[: len(out.token_ids)]
        incl = llm.generate(
            "def f(x):\n",
            SamplingParams(max_tokens=60, ignore_eos=True, stop=stop, include_stop_str_in_output=True),
        ).outputs[0]
        assert incl.text == free.text[: cut + len(stop)]
        tok = free.token_ids[10]
        first = free.token_ids.index(tok)
        by_id = llm.generate(
            "def f(x):\n", SamplingParams(max_tokens=60, ignore_eos=True, stop_token_ids=[tok])
        ).outputs[0]
        assert by_id.token_ids == free.token_ids[: first + 1] and by_id.stop_reason == tok
        later = [i for i, t in enumerate(free.token_ids) if t == tok and i + 1 >= first + 3]
        delayed = llm.generate(
            "def f(x):\n",
            SamplingParams(max_tokens=60, ignore_eos=True, stop_token_ids=[tok], min_tokens=first + 3),
        ).outputs[0]
        if later:
            assert delayed.token_ids == free.token_ids[: later[0] + 1]
        else:
            assert delayed.finish_reason == "length"
        whole = llm.generate(
            "def f(x):\n", SamplingParams(max_tokens=20, ignore_eos=True, exclude_input_from_output=False)
        ).outputs[0]
        assert whole.text.startswith("def f(x):\n")


def test_tensorrt_llm_prompt_forms_give_the_same_output():
    """str, list[int], {"prompt": str} and {"prompt_token_ids": [...]} (TensorRT-LLM's forms)."""
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    with LLM(
        "tiny",
        speculative_config={"decoding_type": "DFlash", "max_draft_len": 7, "speculative_model": "tiny"},
    ) as llm:
        ids = llm.tokenizer("def f(x):", add_special_tokens=False)["input_ids"]
        forms = ["def f(x):", ids, {"prompt": "def f(x):"}, {"prompt_token_ids": ids}]
        outs = llm.generate(forms, sp)
        single = llm.generate({"prompt_token_ids": ids}, sp)
    assert len(outs) == 4 and len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert single.outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert outs[2].prompt == "def f(x):" and outs[3].prompt is None


def test_text_prompts_equal_token_prompts_and_tokenizer():
    with LLM("tiny") as llm:
        text = llm.generate("hello", SamplingParams(max_tokens=12, ignore_eos=True)).outputs[0]
        ids = llm.tokenizer("hello", add_special_tokens=False)["input_ids"]
        tok = llm.generate(ids, SamplingParams(max_tokens=12, ignore_eos=True)).outputs[0]
    assert text.token_ids == tok.token_ids
    assert text.text == llm.tokenizer.decode(text.token_ids, skip_special_tokens=True)


def test_more_than_one_prompt_length_chunked_prefill(pair):
    tdir, ddir, _ = pair
    prompt = [i % 12 for i in range(150)]
    with LLM(str(tdir), speculative_config=spec(ddir), max_num_tokens=32, max_seq_len=256) as llm:
        out = llm.generate(prompt, SamplingParams(max_tokens=20)).outputs[0]
    assert out.token_ids == reference(pair, prompt, SamplingParams(max_tokens=20)).output_ids


def _partitions(items: list[int]):
    """Every partition of `items` into groups (brute force, for a handful of items)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest):
        yield [[first], *part]
        for i in range(len(part)):
            yield [*part[:i], [first, *part[i]], *part[i + 1 :]]


def _passes_cost(part: list[list[int]], lengths: list[int]) -> int:
    return sum(16 + len(g) * max(lengths[i] for i in g) for g in part)


def test_prefill_passes_are_the_cheapest_grouping_of_the_chunks():
    rng = random.Random(3)
    for _ in range(40):
        lengths = [rng.choice([1, 2, 5, 30, 31, 200, rng.randint(1, 400)]) for _ in range(rng.randint(1, 7))]
        groups = pass_groups(lengths, overhead=16)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        best = min(_passes_cost(p, lengths) for p in _partitions(list(range(len(lengths)))))
        assert _passes_cost(groups, lengths) == best, lengths
    assert pass_groups([300, 5, 5, 5]) == [[0], [1, 2, 3]]  # the long one alone, the short ones together
    assert pass_groups([6, 5, 6]) == [[0, 1, 2]]


def test_prompts_of_mixed_lengths_prefill_in_passes_of_their_own_length(pair):
    """A long prompt beside short ones: the short ones are not padded to its length (one pass each
    group), and every request still decodes exactly as it would alone."""
    tdir, ddir, _ = pair
    prompts = [[i % 12 for i in range(n)] for n in (4, 150, 5, 3)]
    sp = SamplingParams(max_tokens=12)
    with LLM(str(tdir), speculative_config=spec(ddir), max_batch_size=4, max_seq_len=256) as llm:
        passes: list[tuple[int, ...]] = []
        executor = llm.engine.executor
        run = executor.prefill
        executor.prefill = lambda args: (passes.append(tuple(args[0].shape)), run(args))[1]  # type: ignore[method-assign]
        outs = llm.generate(prompts, sp)
    assert sorted(passes) == [(1, 150), (3, 5)], passes
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == reference(pair, prompt, sp).output_ids


@pytest.mark.gpu
def test_cuda_graph_rounds_equal_eager_rounds(pair):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    tdir, ddir, _ = pair
    jobs = workload(12, seed=9)
    outs = []
    for eager in (True, False):
        with LLM(str(tdir), speculative_config=spec(ddir), device="cuda", dtype="float32", enforce_eager=eager,
                 max_batch_size=8, max_seq_len=128) as llm:  # fmt: skip
            outs.append(
                [r.outputs[0].token_ids for r in llm.generate([p for p, _ in jobs], [sp for _, sp in jobs])]
            )
            if not eager:
                assert llm.engine.executor._graphs and not llm.engine.executor._graph_failed
    assert outs[0] == outs[1]


@pytest.mark.parametrize("streaming", [False, True])
def test_requests_finishing_in_their_first_step(pair, streaming):
    """Prefill and the first round commit in one step; a request that finishes there must still get
    its final output (a regression: the handle was dropped after the prefill update)."""
    tdir, ddir, _ = pair
    with LLM(str(tdir), speculative_config=spec(ddir), max_batch_size=4, max_seq_len=64) as llm:
        for n in (1, 2, 3):
            h = llm.generate_async([1, 2, 3], SamplingParams(max_tokens=n), streaming=streaming)
            items = list(h)
            assert items[-1].finished and len(items[-1].outputs[0].token_ids) == n
            if streaming:
                counts = [len(i.outputs[0].token_ids) for i in items]
                assert counts == sorted(counts) and counts[0] >= 1


def test_sampled_requests_with_speculation_switched_off(pair):
    """max_concurrency below the batch turns rounds into plain decoding (g = 0); sampled requests
    must then equal plain sampling of the target with the same seeds (a regression: g = 0 crashed
    the rejection rule)."""
    tdir, ddir, model = pair
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
    sps = [SamplingParams(max_tokens=15, temperature=0.9, top_p=0.95, seed=70 + i) for i in range(4)]
    with LLM(
        str(tdir), speculative_config=spec(ddir, max_concurrency=1), max_batch_size=4, max_seq_len=64
    ) as llm:
        res = llm.generate(prompts, sps)
    for p, sp, r in zip(prompts, sps, res):
        plain = spec_generate(HFTarget(model), None, p, max_new_tokens=15,
                              sampling=SamplingConfig(temperature=0.9, top_p=0.95, seed=sp.seed))  # fmt: skip
        assert r.outputs[0].token_ids == plain.output_ids


def test_cpu_thread_policy(monkeypatch):
    from dflash_trt.api.llm import cpu_threads_for
    from dflash_trt.models.target_config import parse_target_config
    from dflash_trt.smollm2 import ensure_smollm2
    from dflash_trt.tiny import ensure_tiny

    def step_parameters(target_dir):
        return parse_target_config(json.loads((target_dir / "config.json").read_text())).num_step_parameters()

    tiny, smollm2 = step_parameters(ensure_tiny().target), step_parameters(ensure_smollm2().target)
    assert 2_000_000 < tiny < 3_000_000 and 130_000_000 < smollm2 < 140_000_000
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cpu_threads_for(tiny, None) == 1  # weights in the caches: one thread
    assert cpu_threads_for(smollm2, None) is None  # weights streamed: torch's default (every core)
    assert cpu_threads_for(tiny, 3) == 3  # an explicit request wins
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert cpu_threads_for(tiny, None) is None  # the user's environment wins over the default


def test_cpu_threads_is_validated_and_applied():
    import torch

    from dflash_trt.api.llm import LLM
    from dflash_trt.errors import ConfigError

    with pytest.raises(ConfigError, match="cpu_threads"):
        LLM("tiny", cpu_threads=0, device="cpu")
    before = torch.get_num_threads()
    try:
        with LLM("tiny", cpu_threads=2, device="cpu", max_batch_size=1) as llm:
            assert llm.cpu_threads == 2 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
