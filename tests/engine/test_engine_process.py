# SPDX-License-Identifier: Apache-2.0
"""The embedded LLM in a process of its own (dflash_trt/api/process.py), as servers run it: the same
tokens as in process, requests refused with their field, cancellation, and every way the child can
end (asked to, killed, its engine raising, its parent gone) ending every request explicitly.
`tiny`, eager, float32 CPU; each test that ends its child starts its own."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_trt import LLM, SamplingParams
from dflash_trt.api.process import ProcessLLM
from dflash_trt.errors import EngineDeadError, RequestError
from dflash_trt.utils.child import OPENMP_SPIN, OPENMP_SPIN_ENV, child_env

SPEC = {"decoding_type": "DFlash", "max_draft_len": 15, "speculative_model": "tiny"}
ARGS = {"model": "tiny", "speculative_config": SPEC, "compile": False, "dtype": "float32"}
PROMPTS = ["def fib(n):", "class Stack:\n    def push(self, x):", "import os\n\ndef walk(root):"]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def proc_llm():
    llm = ProcessLLM(**ARGS)
    yield llm
    llm.shutdown()


def _gone(pid: int, within: float) -> bool:
    """The process has exited within `within` s (a zombie that nobody reaped yet counts as exited)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def _first_output(handle) -> None:
    """Block until a streaming request has produced its first output."""
    for _ in handle:
        return


def test_outputs_equal_the_in_process_llm(proc_llm):
    local = LLM(**ARGS)
    try:
        want = [local.generate_async(p, GREEDY).result(timeout=60) for p in PROMPTS]
    finally:
        local.shutdown()
    handles = [proc_llm.generate_async(p, GREEDY) for p in PROMPTS]  # batched in the child
    got = [h.result(timeout=60) for h in handles]
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].text == w.outputs[0].text
        assert g.prompt_token_ids == w.prompt_token_ids
        assert g.outputs[0].finish_reason == "length"
    assert handles[0].request_id >= 0 and handles[0].prompt_token_ids == want[0].prompt_token_ids

    async def stream():
        sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, return_perf_metrics=True)
        return [o async for o in proc_llm.generate_async(PROMPTS[0], sp, streaming=True)]

    outs = asyncio.run(stream())
    assert len(outs) > 1 and outs[-1].finished and not any(o.finished for o in outs[:-1])
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    assert lengths == sorted(lengths) and outs[-1].outputs[0].token_ids == want[0].outputs[0].token_ids
    # the child sends a request's prompt once; every output the caller sees carries it
    assert all(o.prompt_token_ids == want[0].prompt_token_ids for o in outs)
    spec = outs[-1].outputs[0].request_perf_metrics.speculative_decoding
    assert spec.num_rounds == len(spec.acceptance_lengths) >= 2  # τ > 1 on the trained pair
    deadline = time.monotonic() + 10  # the child's counters arrive every STATS_PERIOD_S
    while not (proc_llm.get_stats().get("active") == 0 and proc_llm.drain_round_times()):
        assert time.monotonic() < deadline, proc_llm.get_stats()
        time.sleep(0.05)
    assert proc_llm.engine_error is None


def _comparable(out):
    """An output without its clock readings (the two engines ran at different times)."""
    comps = []
    for c in out.outputs:
        m = c.request_perf_metrics
        spec = dataclasses.asdict(m.speculative_decoding) if m is not None else None
        comps.append((dataclasses.replace(c, request_perf_metrics=None), spec, m and m.kv_cache_metrics))
    return dataclasses.replace(out, outputs=[], request_id=0), comps


def _streamed(llm, sp, pair):
    """Every output of one streamed request with `sp` and one with `pair`, then the LLM shut down."""
    try:
        return [list(llm.generate_async(PROMPTS[1], sp, streaming=True)),
                list(llm.generate_async(PROMPTS[2], pair, streaming=True))]  # fmt: skip
    finally:
        llm.shutdown()


def test_every_streamed_output_equals_the_in_process_llms():
    """Each output a streaming caller reads (sync iteration: all of them) crosses the pipe in its
    compact form (api/output_codec.py) and arrives equal to the in-process LLM's: text and ids with
    their diffs, log-probabilities, the DFlash statistics and KV figures; for two sequences (n = 2)
    too, whose outputs interleave. A fresh child: its first requests see the cache as the local one."""
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, return_perf_metrics=True, logprobs=2)
    pair = SamplingParams(
        max_tokens=16, temperature=0.8, seed=3, n=2, ignore_eos=True, return_perf_metrics=True
    )
    want, got = _streamed(LLM(**ARGS), sp, pair), _streamed(ProcessLLM(**ARGS), sp, pair)
    for w, g in zip(want, got, strict=True):
        assert len(g) == len(w) > 2
        assert [_comparable(o) for o in g] == [_comparable(o) for o in w]
    assert got[0][-1].outputs[0].logprobs and len(got[1][-1].outputs) == 2


def test_the_engine_process_starts_with_openmp_spin_limited_unless_the_user_set_it(proc_llm, monkeypatch):
    # libgomp reads GOMP_SPINCOUNT once, when the child's torch loads it (utils/child.py)
    raw = Path(f"/proc/{proc_llm.pid}/environ").read_text()
    environ = dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)
    assert environ.get(OPENMP_SPIN_ENV) == os.environ.get(OPENMP_SPIN_ENV, OPENMP_SPIN)
    monkeypatch.setenv(OPENMP_SPIN_ENV, "7")
    assert child_env(X="1")[OPENMP_SPIN_ENV] == "7" and child_env(X="1")["X"] == "1"
    monkeypatch.delenv(OPENMP_SPIN_ENV)
    assert child_env()[OPENMP_SPIN_ENV] == OPENMP_SPIN and OPENMP_SPIN_ENV not in os.environ


def test_the_childs_counters_arrive_while_requests_keep_coming(proc_llm):
    """Stats go out every STATS_PERIOD_S (0.1 s) even when the parent's messages arrive more often
    (they once went out only when 0.1 s passed without one: never, under load)."""
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    seen = set()
    for _ in range(50):  # a request every 30 ms for 1.5 s
        list(proc_llm.generate_async(PROMPTS[0], one, streaming=False))
        seen.add(proc_llm.get_stats().get("steps"))
        time.sleep(0.03)
    assert len(seen) >= 5, seen


def test_a_bad_request_raises_its_request_error_here(proc_llm):
    with pytest.raises(RequestError, match=r"max_tokens=0") as info:
        proc_llm.generate_async(PROMPTS[0], SamplingParams(max_tokens=0))
    assert info.value.field == "max_tokens" and info.value.hint
    assert proc_llm.generate_async(PROMPTS[0], GREEDY).result(timeout=60).outputs[0].finish_reason == "length"


def test_abort_and_sigterm(proc_llm):
    handle = proc_llm.generate_async(PROMPTS[1], LONG, streaming=True)
    _first_output(handle)
    # A SIGTERM to the server's process group must not end the engine under draining requests.
    os.kill(proc_llm.pid, signal.SIGTERM)
    handle.abort()
    final = handle.result(timeout=30)
    assert final.outputs[0].finish_reason == "cancelled"
    assert 0 < len(final.outputs[0].token_ids) < LONG.max_tokens
    assert proc_llm.generate_async(PROMPTS[0], GREEDY).result(timeout=60).finished


def test_a_killed_engine_process_fails_every_request_and_names_the_signal():
    llm = ProcessLLM(**ARGS)
    try:
        running = llm.generate_async(PROMPTS[0], LONG, streaming=True)
        _first_output(running)
        os.kill(llm.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="killed by SIGKILL") as info:
            running.result(timeout=30)
        assert info.value.output.outputs[0].token_ids  # what it produced before the kill is kept
        assert llm.engine_error == "the engine process was killed by SIGKILL"
        with pytest.raises(EngineDeadError, match="killed by SIGKILL"):
            llm.generate_async(PROMPTS[1], GREEDY)
    finally:
        llm.shutdown()


def test_an_engine_failure_is_reported_before_the_requests_it_fails(monkeypatch):
    monkeypatch.setenv("DFLASH_TRT_TESTING", "1")
    monkeypatch.setenv("DFLASH_TRT_FAULT_INJECT", "engine-raise:3")
    llm = ProcessLLM(**ARGS)
    try:
        handle = llm.generate_async(PROMPTS[0], LONG)  # not streaming: the child sends only its end
        with pytest.raises(EngineDeadError, match="injected engine-raise at step 3") as info:
            handle.result(timeout=30)
        assert info.value.output.outputs[0].token_ids  # the tokens of steps 1-2 are kept
        assert llm.engine_error is not None and "InjectedFault" in llm.engine_error  # set before the failure
        with pytest.raises(EngineDeadError, match="the engine is dead"):
            llm.generate_async(PROMPTS[0], GREEDY)
    finally:
        llm.shutdown()
    assert _gone(llm.pid, 10)


def test_shutdown_ends_requests_in_flight_and_is_not_a_death():
    llm = ProcessLLM(**ARGS)
    handle = llm.generate_async(PROMPTS[2], LONG, streaming=True)
    _first_output(handle)
    llm.shutdown()
    with pytest.raises(EngineDeadError, match="the LLM was shut down"):
        handle.result(timeout=5)
    assert llm.engine_error is None and llm._proc.returncode == 0
    with pytest.raises(Exception, match="the LLM was shut down"):
        llm.generate_async(PROMPTS[0], GREEDY)


def test_a_start_failure_raises_what_the_child_raised(tmp_path):
    with pytest.raises(Exception) as local:
        LLM(model=str(tmp_path / "missing"))
    with pytest.raises(type(local.value)) as remote:
        ProcessLLM(model=str(tmp_path / "missing"))
    assert str(remote.value) == str(local.value)


def test_the_engine_process_exits_when_its_parent_dies(tmp_path):
    """A stub killed with SIGKILL leaves no engine behind: the child reads EOF and exits."""
    script = (
        "import os, sys\n"
        "from dflash_trt.api.process import ProcessLLM\n"
        "llm = ProcessLLM(model='tiny', compile=False)\n"
        "print(llm.pid, flush=True)\n"
        "llm.generate_async('def f():', __import__('dflash_trt').SamplingParams(max_tokens=1500, ignore_eos=True))\n"
        "sys.stdin.read()\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        child = int(parent.stdout.readline())
        os.kill(child, 0)  # alive
        parent.kill()
        parent.wait(timeout=10)
        assert _gone(child, 30), f"engine process {child} outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()


@pytest.mark.timeout(60)  # a link that writes on the sender's thread blocks here for good
def test_the_childs_sends_never_wait_on_a_parent_that_does_not_read():
    """The engine thread hands a step's outputs to the link and goes on: a parent that reads nothing
    for a while (a full pipe) does not hold it up, and every message then arrives once, in order."""
    from multiprocessing.connection import Connection

    from dflash_trt.api.process import _Link

    rx_fd, tx_fd = os.pipe()
    rx, link = Connection(rx_fd, writable=False), _Link(Connection(tx_fd, readable=False))
    payload = "x" * 200_000  # larger than a pipe's buffer: one message alone would block a writer
    t0 = time.monotonic()
    for i in range(20):
        link.send(("stats", i, payload))
    assert time.monotonic() - t0 < 1.0  # nothing has been read yet
    got = [rx.recv()[1] for _ in range(20)]
    link.close()
    assert got == list(range(20))
    rx.close()
