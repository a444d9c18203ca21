# SPDX-License-Identifier: Apache-2.0
"""DDTree in the embedded engine (float32 CPU): every request equals the batch-1 reference loop's
DDTree token for token (greedy and seeded sampling) and greedy equals plain decoding, in batches of
mixed requests, in eager, static-padded and compiled rounds; sampled output is distributed as the
target's; the tree's scratch columns stay inside each request's reserved pages."""

from __future__ import annotations

import pytest
import torch

from dflash_trt import LLM, SamplingParams
from dflash_trt.models.checkpoint import load_drafter, save_drafter
from dflash_trt.reference.generate import spec_generate
from dflash_trt.reference.hf_target import HFTarget
from dflash_trt.spec.sampling import SamplingConfig
from tests.conftest import make_drafter, make_target
from tests.engine.test_llm import BLOCK, pair, spec, workload  # noqa: F401  (pair: a fixture)
from tests.test_sampling import chi_square_p, exact_joint


def ref_tree(model, ddir, prompt, sp: SamplingParams, budget: int, block: int = BLOCK):
    """The reference loop's DDTree (tree_budget=budget) for one request: the engine's oracle."""
    temperature = 0.0 if sp.temperature is None else sp.temperature
    cfg = SamplingConfig(temperature=temperature, top_k=sp.top_k or 0, top_p=sp.top_p or 1.0, seed=sp.seed)
    return spec_generate(HFTarget(model), load_drafter(ddir), prompt, max_new_tokens=sp.max_tokens, sampling=cfg,
                         block_size=block, tree_budget=budget)  # fmt: skip


def perf(sp: SamplingParams) -> SamplingParams:
    return SamplingParams(**{**vars(sp), "return_perf_metrics": True})


@pytest.mark.parametrize("static_rounds", [False, True], ids=["eager", "static-padded"])
@pytest.mark.parametrize("budget", [3, 12, 40])
def test_tree_engine_equals_reference_ddtree_and_plain_greedy(pair, static_rounds, budget):  # noqa: F811
    """Concurrent requests of different lengths, greedy and sampled (temperature, top-k/top-p) in one
    batch: each gets exactly the reference DDTree's tokens and round lengths; greedy ones also
    equal plain decoding."""
    tdir, ddir, model = pair
    jobs = workload(12, seed=budget)
    llm = LLM(str(tdir), speculative_config=spec(ddir, tree_budget=budget), max_batch_size=5, max_num_tokens=64,
              max_seq_len=128)  # fmt: skip
    # CPU rounds build their trees in dflash_tree::best_first (CI has a C++ compiler) ...
    assert llm.engine.parts.native_tree
    if static_rounds:  # padded static buffers: the exact path a CUDA graph captures
        llm.engine.executor.static_rounds = True
        llm.engine.executor.graph_batch_sizes = (2, 5)
        llm.engine.parts.native_tree = False  # ... CUDA rounds in the batched torch builder
    try:
        results = llm.generate([p for p, _ in jobs], [perf(sp) for _, sp in jobs])
        stats = llm.get_stats()
    finally:
        llm.shutdown()
    accepted = 0
    for (prompt, sp), res in zip(jobs, results):
        out = res.outputs[0]
        ref = ref_tree(model, ddir, prompt, sp, budget)
        assert out.token_ids == ref.output_ids, (prompt, sp)
        m = out.request_perf_metrics.speculative_decoding
        assert m.acceptance_lengths == ref.acceptance_lengths
        assert m.total_draft_tokens == ref.num_draft_tokens  # the trees' drafted nodes
        assert m.tree_budgets == [budget] * m.num_rounds
        if not sp.temperature:
            plain = spec_generate(HFTarget(model), None, prompt, max_new_tokens=sp.max_tokens)
            assert out.token_ids == plain.output_ids
        accepted += m.total_accepted_draft_tokens
    assert accepted > 10, "drafts were rarely accepted: the comparison has no teeth"
    assert stats["kv_free_tokens"] == stats["kv_capacity_tokens"] and stats["tree_budget"] == budget


@pytest.mark.parametrize("arch", ["llama", "gpt_oss"])
def test_tree_engine_on_other_architectures(tmp_path, arch):
    """Llama, and gpt-oss (sliding-window layers, attention sinks, MoE): greedy trees equal plain
    decoding and the reference DDTree, batched."""
    target = make_target(arch, seed=11)
    tdir, ddir = tmp_path / "t", tmp_path / "d"
    target.save_pretrained(tdir)
    save_drafter(make_drafter(target, block_size=5, seed=12, std=0.5), ddir)
    prompts = [[1, 2, 3, 4, 5], [7] * 11, [9, 4, 33, 2]]
    sp = SamplingParams(max_tokens=24)
    cfg = {"decoding_type": "DFlash", "max_draft_len": 4, "speculative_model": str(ddir), "tree_budget": 9}
    with LLM(str(tdir), speculative_config=cfg, max_batch_size=3, max_seq_len=96) as llm:
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    for prompt, out in zip(prompts, outs):
        assert out == spec_generate(HFTarget(target), None, prompt, max_new_tokens=24).output_ids
        assert out == ref_tree(target, ddir, prompt, sp, 9, block=5).output_ids


@pytest.mark.parametrize("budget", [16, 64])
def test_tiny_pair_trees_equal_plain_greedy(budget):
    """The trained tiny pair (block 16): DDTree greedy output equals linear DFlash's and plain
    decoding's, and its trees accept more per round than the chain."""
    from dflash_trt.tiny import heldout_prompts

    prompts = heldout_prompts()[4:8]
    sp = SamplingParams(max_tokens=48, ignore_eos=True, return_perf_metrics=True)
    tiny = {"decoding_type": "DFlash", "max_draft_len": 15, "speculative_model": "tiny"}
    outs = {}
    for tree in (0, budget):
        with LLM(
            "tiny", speculative_config={**tiny, "tree_budget": tree}, max_batch_size=4, max_seq_len=512
        ) as llm:
            outs[tree] = llm.generate(prompts, sp)
    with LLM("tiny", max_batch_size=4, max_seq_len=512) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert [o.outputs[0].token_ids for o in outs[budget]] == plain
    assert [o.outputs[0].token_ids for o in outs[0]] == plain

    def rounds(results) -> int:
        return sum(o.outputs[0].request_perf_metrics.speculative_decoding.num_rounds for o in results)

    assert rounds(outs[budget]) < rounds(outs[0])


def test_seeded_tree_sampling_equals_plain_seeded_sampling(pair):  # noqa: F811
    """A node draws with the uniform of the position it fills, as plain decoding does: seeded
    requests emit plain sampling's very tokens (temperature, top-k, top-p), batched."""
    tdir, ddir, _ = pair
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10], [11, 3]]
    sps = [
        SamplingParams(max_tokens=25, temperature=1.0, seed=5),
        SamplingParams(max_tokens=25, temperature=0.7, top_k=4, seed=6),
        SamplingParams(max_tokens=25, temperature=1.2, top_p=0.8, seed=7),
        SamplingParams(max_tokens=25, temperature=0.9, top_k=5, top_p=0.9, seed=8),
        SamplingParams(max_tokens=25, seed=9),
    ]
    with LLM(str(tdir), max_batch_size=5, max_seq_len=64) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, sps)]
    with LLM(
        str(tdir), speculative_config=spec(ddir, tree_budget=12), max_batch_size=5, max_seq_len=64
    ) as llm:
        tree = llm.generate(prompts, [perf(sp) for sp in sps])
    assert [o.outputs[0].token_ids for o in tree] == plain
    accepted = sum(
        o.outputs[0].request_perf_metrics.speculative_decoding.total_accepted_draft_tokens for o in tree
    )
    assert accepted > 0, "no draft was ever accepted: the test proves little"


def test_tree_engine_sampling_preserves_target_distribution(tmp_path):
    """1500 requests with different seeds, batched: prefill token + one tree round of depth 2; the
    joint distribution of the 3 generated tokens is the target's (temperature, top-k, top-p
    together)."""
    sampling = SamplingConfig(temperature=0.8, top_k=4, top_p=0.85)
    target = make_target("qwen3", seed=5, vocab=5, layers=4)
    target.save_pretrained(tmp_path / "t")
    save_drafter(make_drafter(target, block_size=3, std=0.6, seed=3), tmp_path / "d")
    prompt = [1, 3, 2]
    exact = exact_joint(target, prompt, sampling, steps=3)  # [5, 5, 5]
    runs = 1500
    sps = [
        perf(SamplingParams(max_tokens=3, temperature=0.8, top_k=4, top_p=0.85, seed=s)) for s in range(runs)
    ]
    cfg = {
        "decoding_type": "DFlash",
        "max_draft_len": 2,
        "speculative_model": str(tmp_path / "d"),
        "tree_budget": 4,
    }
    with LLM(str(tmp_path / "t"), speculative_config=cfg, max_batch_size=64, max_seq_len=16) as llm:
        outs = llm.generate([prompt] * runs, sps)
    counts = torch.zeros_like(exact)
    accepted = 0
    for o in outs:
        counts[tuple(o.outputs[0].token_ids)] += 1
        accepted += o.outputs[0].request_perf_metrics.speculative_decoding.total_accepted_draft_tokens
    assert accepted / runs > 0.1, "drafts were (almost) never accepted: the test proves little"
    assert chi_square_p(counts, exact) > 1e-3


def test_tree_scratch_stays_in_the_request_pages(pair, monkeypatch):  # noqa: F811
    """Requests whose last rounds run trees right up to max_len (prompt + max_tokens a whole number
    of pages): the scheduler reserves the tree's scratch columns, and a round that would write
    past a request's pages is refused instead of touching another request's cache."""
    tdir, ddir, model = pair
    prompts = [[1] * 6, [2, 3] * 5, [4] * 3]
    sps = [SamplingParams(max_tokens=16 * k - len(p)) for k, p in zip((1, 2, 3), prompts)]
    with LLM(
        str(tdir), speculative_config=spec(ddir, tree_budget=20), max_batch_size=3, max_seq_len=64
    ) as llm:
        assert llm.engine.scheduler.pages_needed(6, 10) == 3  # 16 tokens + 20 scratch columns
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, sps)]
        for p, sp, out in zip(prompts, sps, outs):
            assert out == spec_generate(HFTarget(model), None, p, max_new_tokens=sp.max_tokens).output_ids
        monkeypatch.setattr(llm.engine.scheduler, "scratch_tokens", 0)  # a scheduler that forgot it
        with pytest.raises(Exception, match=r"a round needs cache columns up to \d+ but it holds 1 pages"):
            llm.generate([1] * 6, SamplingParams(max_tokens=10))


@pytest.mark.slow
def test_compiled_tree_rounds_equal_eager_rounds(pair):  # noqa: F811
    """The tree round through torch.compile (inductor): one graph, no graph break, and the eager
    engine's tokens for a mixed batch (greedy and seeded sampling). One compilation only (minutes on
    2 cores): the rounds after the batch shrinks run eagerly, as after a serving warm-up."""
    from torch._dynamo.utils import counters

    tdir, ddir, _ = pair
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    sps = [SamplingParams(max_tokens=30), SamplingParams(max_tokens=30, temperature=0.9, top_k=6, seed=3),
           SamplingParams(max_tokens=30, temperature=1.1, seed=4)]  # fmt: skip
    cfg = spec(ddir, tree_budget=12)
    with LLM(str(tdir), speculative_config=cfg, max_batch_size=4, max_seq_len=128, compile=False) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, sps)]
    # no watchdog: the compiling step takes minutes
    with LLM(str(tdir), speculative_config=cfg, max_batch_size=4, max_seq_len=128, compile=False,
             wedge_timeout_s=None) as llm:  # fmt: skip
        counters.clear()
        runner, executor = llm.engine.runner, llm.engine.executor
        executor.enable_compile()
        executor.compile_prefill = False  # the prefill runs eagerly: one graph is the tree round's
        run = runner.decode_round

        def compile_once(*args, **kwargs):
            out = run(*args, **kwargs)
            executor.freeze()  # the first round compiled; later shape classes run eagerly
            return out

        runner.decode_round = compile_once
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sps)]
        assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert got == want
