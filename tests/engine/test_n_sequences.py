# SPDX-License-Identifier: Apache-2.0
"""n > 1 and best_of: one prefill of the prompt, then n sequences that run as requests of their own.

Sequence i is keyed by `sequence_seed(seed, i)`, so it must equal a separate request sent with that
seed, token for token, with DFlash as without (eager, static rounds, a DDTree engine), penalties and
log-probabilities included. The prompt is prefilled once; aborting the request ends every sequence and
leaks no page; best_of returns the n most likely of its sequences.
"""

from __future__ import annotations

import pytest
import torch

from dflash_trt import LLM, SamplingParams
from dflash_trt.engine.admission import sequence_seed
from dflash_trt.engine.assemble import build_engine
from dflash_trt.engine.config import EngineConfig
from dflash_trt.engine.request import RequestParams
from dflash_trt.errors import RequestError
from dflash_trt.spec.decoding_config import DFlashDecodingConfig


@pytest.fixture(scope="module")
def tiny():
    from dflash_trt.tiny import build_byte_tokenizer, ensure_tiny, heldout_prompts

    paths = ensure_tiny()
    tok = build_byte_tokenizer()
    return paths, [tok.encode(t)[:40] for t in heldout_prompts()[:2]]


def engine_for(paths, *, draft: bool = True, static: bool = False, tree: int = 0, batch: int = 8, kv=None):
    spec = DFlashDecodingConfig(max_draft_len=15, tree_budget=tree) if draft else None
    config = EngineConfig(max_batch_size=batch, max_seq_len=160, static_rounds=static, compile=False,
                          kv_max_tokens=kv)  # fmt: skip
    return build_engine(target_dir=paths.target, drafter_dir=paths.drafter if draft else None, spec=spec,
                        tokenizer=None, config=config, device=torch.device("cpu"), dtype=torch.float32)  # fmt: skip


def run(engine, jobs):
    leaders = [engine.add_request(prompt, params) for prompt, params in jobs]
    groups = [leader.group for leader in leaders]
    while engine.has_work():
        engine.step()
    return groups


CASES = [
    {"temperature": 0.8, "seed": 11},
    {"temperature": 1.0, "top_p": 0.9, "seed": 12, "repetition_penalty": 1.3, "logprobs": 2},
    {"temperature": 0.0},
]


@pytest.mark.parametrize(("draft", "static", "tree"), [(True, False, 0), (True, True, 0), (True, False, 15),
                                                       (False, False, 0)])  # fmt: skip
@pytest.mark.parametrize("case", CASES)
def test_each_sequence_equals_a_separate_request_with_its_seed(tiny, draft, static, tree, case):
    """One case per run: whether a DDTree engine verifies a tree or the chain depends on the batch's
    options (penalties and logprobs verify the chain), and so do its random draws."""
    paths, prompts = tiny
    jobs = [(p, RequestParams(max_tokens=24, ignore_eos=True, n=3, **case)) for p in prompts]
    singles = [
        (p, RequestParams(max_tokens=24, ignore_eos=True, **{**case, "seed": sequence_seed(case.get("seed", 0), i)}))
        for p in prompts for i in range(3)
    ]  # fmt: skip
    grouped = run(engine_for(paths, draft=draft, static=static, tree=tree), jobs)
    alone = [g[0] for g in run(engine_for(paths, draft=draft, static=static, tree=tree), singles)]
    seqs = [r for g in grouped for r in g]
    assert [r.index for r in seqs] == [0, 1, 2] * len(jobs)
    for got, want in zip(seqs, alone):
        if case["temperature"] == 0:  # greedy: every sequence is the greedy output (seeds play no part)
            want = alone[seqs.index(got) - got.index]
        assert got.output_ids == want.output_ids
        if want.logprobs is not None:
            for (a, ra, _), (b, rb, _) in zip(got.token_logprobs, want.token_logprobs, strict=True):
                assert abs(a - b) < 1e-4 and ra == rb
    if case["temperature"] > 0:
        assert all(len({tuple(r.output_ids) for r in g}) > 1 for g in grouped), (
            "sequences are not independent"
        )
    if draft:
        assert sum(r.num_accepted_draft_tokens for r in seqs) > 10


def test_the_prompt_is_prefilled_once_and_no_page_leaks(tiny):
    paths, prompts = tiny
    engine = engine_for(paths)
    chunks: list[tuple[int, int]] = []
    prefill = engine.runner.prefill
    engine.runner.prefill = lambda reqs, ch: (chunks.extend(ch), prefill(reqs, ch))[1]  # type: ignore[method-assign]
    free = engine.scheduler.pages_available
    (group,) = run(engine, [(prompts[0], RequestParams(max_tokens=16, temperature=0.9, n=4))])
    assert sum(hi - lo for lo, hi in chunks) == len(prompts[0])
    assert [len(r.output_ids) for r in group] == [16] * 4
    assert engine.scheduler.pages_available == free and sorted(engine.scheduler.free_rows) == list(range(8))


def test_aborting_the_leader_before_its_prefill_ends_every_sequence(tiny):
    paths, prompts = tiny
    engine = engine_for(paths)
    free = engine.scheduler.pages_available
    leader = engine.add_request(prompts[0], RequestParams(max_tokens=16, temperature=0.9, n=3))
    group = leader.group
    engine.abort(leader.request_id)
    updates = engine.step()
    assert {u.req.request_id for u in updates if u.finished} == {r.request_id for r in group}
    assert all(r.finish_reason == "cancelled" for r in group) and not engine.has_work()
    assert engine.scheduler.pages_available == free


def test_a_group_waits_until_all_its_pages_are_free_and_too_big_is_refused(tiny):
    paths, prompts = tiny
    need = engine_for(paths).scheduler.pages_needed(len(prompts[0]), 24)
    engine = engine_for(paths, kv=16 * (2 * need + need // 2))  # one group of 2 fits, not two, never 3
    assert 2 * need <= engine.num_kv_pages < 3 * need
    first = engine.add_request(prompts[0], RequestParams(max_tokens=24, temperature=0.7, n=2))
    second = engine.add_request(prompts[1], RequestParams(max_tokens=24, temperature=0.7, n=2))
    groups = first.group + second.group
    engine.step()
    assert [r.status.value for r in groups] == [
        "running",
        "running",
        "waiting",
        "waiting",
    ]  # prefilled in one step
    while engine.has_work():
        engine.step()
    assert all(len(r.output_ids) == 24 for r in groups)
    with pytest.raises(RequestError, match="n=3: 3 sequences need") as info:
        engine.add_request(prompts[0], RequestParams(max_tokens=24, n=3))
    assert info.value.field == "n"


def test_llm_api_outputs_streaming_and_best_of(tiny):
    paths, prompts = tiny
    with LLM(str(paths.target), speculative_config={"decoding_type": "DFlash", "max_draft_len": 15,
                                                     "speculative_model_dir": str(paths.drafter)},
             max_batch_size=8, compile=False) as llm:  # fmt: skip
        out = llm.generate(
            prompts[0], SamplingParams(n=3, temperature=0.9, seed=4, max_tokens=12, logprobs=1)
        )
        assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
        for i, c in enumerate(out.outputs):
            alone = llm.generate(prompts[0], SamplingParams(temperature=0.9, seed=sequence_seed(4, i), max_tokens=12,
                                                            logprobs=1)).outputs[0]  # fmt: skip
            assert (
                c.token_ids == alone.token_ids and abs(c.cumulative_logprob - alone.cumulative_logprob) < 1e-4
            )
        streamed = list(llm.generate_async(prompts[0], SamplingParams(n=2, temperature=0.9, seed=4, max_tokens=12,
                                                                      logprobs=0), streaming=True))  # fmt: skip
        # every output carries both sequences, a sequence without output yet with no log-probabilities
        assert all(
            c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
            for o in streamed
            for c in o.outputs
        )
        assert any(not o.outputs[1].token_ids for o in streamed)  # the first output came before sequence 1's
        assert all(len(o.outputs) == 2 for o in streamed) and streamed[-1].finished
        for i in range(2):
            assert [t for o in streamed for t in o.outputs[i].token_ids_diff] == out.outputs[i].token_ids
        best = llm.generate(prompts[0], SamplingParams(n=2, best_of=4, temperature=1.0, seed=9, max_tokens=12,
                                                       logprobs=0))  # fmt: skip
        every = [llm.generate(prompts[0], SamplingParams(temperature=1.0, seed=sequence_seed(9, i), max_tokens=12,
                                                         logprobs=0)).outputs[0] for i in range(4)]  # fmt: skip
        ranked = sorted(every, key=lambda c: -c.cumulative_logprob)[:2]
        assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked]
        assert [c.index for c in best.outputs] == [0, 1]
        assert (
            llm.generate(prompts[0], SamplingParams(n=2, best_of=3, max_tokens=4))
            .outputs[0]
            .cumulative_logprob
            is None
        )
        with pytest.raises(RequestError, match="cannot stream") as info:
            llm.generate_async(prompts[0], SamplingParams(n=1, best_of=2), streaming=True)
        assert info.value.field == "best_of"


def test_a_batch_wider_than_the_cpu_kv_budget_runs_whole_while_its_pages_fit(tiny):
    """On the CPU the KV cache holds CPU_FULL_SEQUENCES requests of max_seq_len tokens (engine/assemble.py),
    not max_batch_size of them: 40 short requests still run in one batch, and longer ones wait for pages."""
    from dflash_trt.engine.assemble import CPU_FULL_SEQUENCES
    from dflash_trt.layers.kv_cache import pages_for

    paths, prompts = tiny
    engine = engine_for(paths, draft=False, batch=64)
    per_sequence = pages_for(160 + engine.scheduler.scratch_tokens, engine.scheduler.page_size)
    assert engine.num_kv_pages == CPU_FULL_SEQUENCES * per_sequence
    assert engine_for(paths, draft=False, batch=4).num_kv_pages == 4 * per_sequence  # narrower: as before
    assert engine_for(paths, draft=False, batch=64, kv=64 * 160).num_kv_pages == 64 * 10  # the user's budget
    short = RequestParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    jobs = [(prompts[i % 2][:8], short) for i in range(40)]  # 1 page each: 40 fit, 40 > 16
    groups = run_one_step(engine, jobs)
    assert sum(1 for g in groups if g[0].pages) == 40  # every one admitted in the first step
    while engine.has_work():
        engine.step()
    assert all(len(g[0].output_ids) == 8 for g in groups)
    long = RequestParams(max_tokens=160 - 8, temperature=0.0, ignore_eos=True)
    groups = run_one_step(engine, [(prompts[0][:8], long)] * (CPU_FULL_SEQUENCES + 4))
    assert sum(1 for g in groups if g[0].pages) == CPU_FULL_SEQUENCES  # the rest wait for pages
    while engine.has_work():
        engine.step()
    assert all(len(g[0].output_ids) == 160 - 8 for g in groups)


def run_one_step(engine, jobs):
    leaders = [engine.add_request(prompt, params) for prompt, params in jobs]
    engine.step()
    return [leader.group for leader in leaders]
