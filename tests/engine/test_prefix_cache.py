# SPDX-License-Identifier: Apache-2.0
"""Prefix caching (engine/prefix_cache.py): greedy outputs and DFlash's acceptance are the same with the
cache on as off (DFlash, DFlash 2, DDTree, plain decoding; chunked prefill; a pool too small to keep every
prefix); no page leaks; requests that share a prefix while it is being prefilled; the counters."""

from __future__ import annotations

import pytest
import torch

from dflash_trt import LLM, SamplingParams
from dflash_trt.engine.assemble import build_engine
from dflash_trt.engine.config import PAGE_SIZE, EngineConfig
from dflash_trt.engine.prefix_cache import PrefixCache
from dflash_trt.engine.request import RequestParams
from dflash_trt.layers.kv_cache import PageAllocator
from dflash_trt.spec.decoding_config import DFlashDecodingConfig


def test_pages_are_keyed_by_their_whole_prefix_shared_and_evicted_lru():
    cache = PrefixCache(PageAllocator(8), page_size=4)  # pages 1..7
    a = list(range(13))  # three full pages, then one token
    pages = cache.allocate(4)
    assert cache.match(a) == []
    cache.register(a, pages)  # the three full pages
    assert cache.match(a) == pages[:3]
    assert cache.match(a[:12]) == pages[:2]  # the last token's page always runs
    assert cache.match([99, *a[1:]]) == []  # same later pages behind another first page: no match
    cache.release(pages)  # three idle cached pages, the fourth freed
    assert cache.num_available == 7 and cache.stats()["prefix_cache_idle_pages"] == 3
    hit = cache.match(a)
    cache.claim(hit)
    assert cache.num_available == 4  # taken pages are evictable no more
    fresh = cache.allocate(4)  # the free list has 4
    assert not set(fresh) & set(hit) and cache.match(a) == hit
    cache.release(fresh)
    cache.release(hit)
    cache.allocate(6)  # evicts the least recently used cached pages to make room
    assert cache.match(a) == [] and cache.stats()["prefix_cache_pages"] == 2 - 1  # one page left cached


@pytest.fixture(scope="module")
def tiny():
    from dflash_trt.tiny import build_byte_tokenizer, ensure_tiny, heldout_prompts

    tok = build_byte_tokenizer()
    system = tok.encode("".join(heldout_prompts()[:3]))[:150]  # a shared "system prompt" of 8 full pages
    tails = [tok.encode(t)[:20] for t in heldout_prompts()[3:9]]
    return ensure_tiny(), system, tails


def engine_for(paths, *, cache: bool, draft: str | None = "v1", tree: int = 0, kv=None, chunk: int = 2048):
    drafter = {"v1": paths.drafter, "dflash2": paths.drafter_dflash2, None: None}[draft]
    spec = DFlashDecodingConfig(max_draft_len=15, tree_budget=tree) if drafter is not None else None
    config = EngineConfig(max_batch_size=4, max_seq_len=256, max_num_tokens=chunk, compile=False,
                          kv_max_tokens=kv, prefix_caching=cache)  # fmt: skip
    engine = build_engine(target_dir=paths.target, drafter_dir=drafter, spec=spec, tokenizer=None, config=config,
                          device=torch.device("cpu"), dtype=torch.float32)  # fmt: skip
    engine.planner.pin(15, tree)  # rounds of one shape: a draft length chosen by timing would differ
    return engine


def serve(engine, waves):
    """Each wave's requests at once, the next wave once the engine is idle."""
    done = []
    for wave in waves:
        reqs = [engine.add_request(p, RequestParams(max_tokens=32, ignore_eos=True)) for p in wave]
        while engine.has_work():
            engine.step()
        done += reqs
    return done


@pytest.mark.parametrize(
    ("draft", "tree", "kv", "chunk"),
    [("v1", 0, None, 2048), ("v1", 0, None, 48), ("dflash2", 0, None, 2048), ("v1", 15, None, 2048),
     (None, 0, None, 2048), ("v1", 0, 16 * 40, 2048)],
    ids=["dflash", "chunked", "dflash2", "ddtree", "plain", "evicting"],
)  # fmt: skip
def test_cache_on_equals_cache_off_with_the_same_acceptance(tiny, draft, tree, kv, chunk):
    paths, system, tails = tiny
    waves = [
        [system + tails[0]],
        [system + t for t in tails[1:4]],
        [system + tails[4], system[:70] + tails[5]],
    ]
    on = engine_for(paths, cache=True, draft=draft, tree=tree, kv=kv, chunk=chunk)
    off = engine_for(paths, cache=False, draft=draft, tree=tree, kv=kv, chunk=chunk)
    got, want = serve(on, waves), serve(off, waves)
    for a, b in zip(got, want):
        assert a.output_ids == b.output_ids
        assert a.acceptance_lengths == b.acceptance_lengths  # the drafter's context came with the pages
    hits = [r.cached_tokens for r in got]
    shared = len(system) // PAGE_SIZE * PAGE_SIZE
    assert hits[0] == 0 and hits[1:5] == [shared] * 4 and hits[5] == 4 * PAGE_SIZE
    stats = on.stats()
    assert stats["prefix_cache_hits"] == sum(hits) and stats["prefix_cache_queries"] == sum(
        len(p) for w in waves for p in w
    )
    sched = on.scheduler
    assert sched.pages_available == on.num_kv_pages  # no leak: every page free, or cached and idle
    if kv is not None:
        assert sched.cache is not None and sched.cache.stats()["prefix_cache_pages"] < 16


def test_requests_sharing_a_prefix_while_it_is_prefilled(tiny):
    """Admitted together, with the prompt prefilled in chunks: none of them hits (nothing is cached before
    a prompt completes), and all are right; the next one hits."""
    paths, system, tails = tiny
    wave = [system + t for t in tails[:3]]
    got = serve(engine_for(paths, cache=True, chunk=32), [wave, [system + tails[3]]])
    want = serve(engine_for(paths, cache=False, chunk=32), [wave, [system + tails[3]]])
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert [r.cached_tokens for r in got[:3]] == [0, 0, 0] and got[3].cached_tokens == len(system) // 16 * 16


def test_llm_api_reports_cached_tokens_and_can_turn_it_off(tiny):
    _, system, tails = tiny
    spec = {"decoding_type": "DFlash", "max_draft_len": 15, "speculative_model": "tiny"}
    sp = SamplingParams(max_tokens=8, ignore_eos=True, return_perf_metrics=True)
    with LLM("tiny", speculative_config=spec, max_batch_size=2, compile=False) as llm:
        first, second = (llm.generate(system + t, sp) for t in tails[:2])
        scored = llm.generate(system + tails[2], SamplingParams(max_tokens=1, prompt_logprobs=0))
    shared = len(system) // PAGE_SIZE
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == shared * PAGE_SIZE
    kv = second.outputs[0].request_perf_metrics.kv_cache_metrics
    missed = (len(system + tails[1]) - 1) // PAGE_SIZE - shared
    assert (kv.num_reused_blocks, kv.num_missed_blocks) == (shared, missed) and kv.kv_cache_hit_rate > 0.5
    assert scored.num_cached_tokens == 0  # scoring the prompt needs every position's logits
    with LLM("tiny", speculative_config=spec, max_batch_size=2, compile=False,
             kv_cache_config={"enable_block_reuse": False}) as llm:  # fmt: skip
        outs = [llm.generate(system + t, sp) for t in tails[:2]]
        assert "prefix_cache_queries" not in llm.get_stats()
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    assert outs[1].outputs[0].token_ids == second.outputs[0].token_ids
