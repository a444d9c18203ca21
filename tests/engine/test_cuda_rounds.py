# SPDX-License-Identifier: Apache-2.0
"""CUDA-graph rounds for every kind of round the engine runs: DDTree verification (per budget) and
DFlash 2 drafters (selector walk and block-local conv through the dflash:: ops, the CUDA default).
A captured round must give the eager round's tokens on the same device for a mixed batch (greedy and
seeded sampling, requests joining and leaving), and greedy requests must equal plain decoding of
the target (the CPU reference loop, float32). Needs CUDA; the GPU check runs it (bench/gpu_check.sh)."""

from __future__ import annotations

import pytest
import torch

from dflash_trt import LLM, SamplingParams
from dflash_trt.reference.generate import spec_generate
from dflash_trt.reference.hf_target import HFTarget
from tests.engine.test_llm import pair, spec, workload  # noqa: F401  (pair: a fixture)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def run_both(tdir, speculative_config, jobs, **kw):
    """(eager outputs, captured outputs, the captured run's runner facts) on CUDA, float32."""
    outs, facts = [], {}
    for eager in (True, False):
        with LLM(str(tdir), speculative_config=speculative_config, device="cuda", dtype="float32",
                 enforce_eager=eager, max_batch_size=4, max_seq_len=192, **kw) as llm:  # fmt: skip
            res = llm.generate([p for p, _ in jobs], [sp for _, sp in jobs])
            outs.append([r.outputs[0] for r in res])
            if not eager:
                executor = llm.engine.executor
                facts = {"graphs": len(executor._graphs), "failed": executor._graph_failed,
                         "plugins": llm.engine.parts.backend.plugins}  # fmt: skip
    return outs[0], outs[1], facts


def assert_greedy_is_plain(model, jobs, token_ids: list[list[int]]) -> None:
    for (prompt, sp), ids in zip(jobs, token_ids):
        if not sp.temperature:
            plain = spec_generate(HFTarget(model), None, prompt, max_new_tokens=sp.max_tokens)
            assert ids == plain.output_ids, prompt


@pytest.mark.parametrize("budget", [12, 40])
def test_tree_rounds_in_cuda_graphs_equal_eager_rounds(pair, budget):  # noqa: F811
    tdir, ddir, model = pair
    jobs = [
        (p, SamplingParams(**{**vars(sp), "return_perf_metrics": True})) for p, sp in workload(10, seed=5)
    ]
    eager, graphed, facts = run_both(tdir, spec(ddir, tree_budget=budget), jobs)
    assert facts["graphs"] > 0 and not facts["failed"], facts
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    lengths = [o.request_perf_metrics.speculative_decoding.acceptance_lengths for o in graphed]
    assert lengths == [o.request_perf_metrics.speculative_decoding.acceptance_lengths for o in eager]
    assert sum(sum(x) - len(x) for x in lengths) > 10, "drafts were rarely accepted: no teeth"
    assert_greedy_is_plain(model, jobs, [o.token_ids for o in graphed])


def test_tiny_dflash2_rounds_in_cuda_graphs_equal_eager_rounds():
    """The shipped trained DFlash 2 drafter (its selector overturns real slots) on the dflash:: ops."""
    from transformers import AutoModelForCausalLM

    from dflash_trt.models.sources import load_tokenizer
    from dflash_trt.tiny import ensure_tiny, heldout_prompts

    paths = ensure_tiny()
    model = AutoModelForCausalLM.from_pretrained(paths.target, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(paths.target)
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in heldout_prompts()[:6]]
    sps = [SamplingParams(max_tokens=48, ignore_eos=True, return_perf_metrics=True, **kw)
           for kw in ({}, {"temperature": 0.8, "seed": 11}, {"temperature": 1.1, "top_k": 8, "seed": 12})] * 2  # fmt: skip
    jobs = list(zip(prompts, sps))
    # the full block at every batch size: the per-round acceptance lengths compared below depend on the
    # draft length, which "auto" would pick by wall time in each engine
    cfg = {
        "decoding_type": "DFlash",
        "max_draft_len": 15,
        "speculative_model": str(paths.drafter_dflash2),
        "max_concurrency": 64,
    }
    eager, graphed, facts = run_both(paths.target, cfg, jobs)
    assert facts["graphs"] > 0 and not facts["failed"] and facts["plugins"], facts
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    metrics = [o.request_perf_metrics.speculative_decoding for o in graphed]
    assert [m.acceptance_lengths for m in metrics] == [
        o.request_perf_metrics.speculative_decoding.acceptance_lengths for o in eager
    ]
    drafted = sum(m.total_draft_tokens for m in metrics)
    overturned = sum(m.total_overturned_draft_tokens for m in metrics)
    assert overturned > 0.05 * drafted, f"the selector overturned {overturned} of {drafted} slots"
    assert_greedy_is_plain(model, jobs, [o.token_ids for o in graphed])


@pytest.mark.parametrize("drafted", [False, True], ids=["plain", "dflash"])
def test_compile_true_on_cuda_equals_eager_rounds(pair, drafted):  # noqa: F811
    """compile=True on a GPU: each shape class's round compiled (inductor's Triton kernels) and captured
    in CUDA graphs at every padded page width. Plain and DFlash rounds must both run compiled graphs
    (for the classes the warm-up compiles: greedy and plain sampling; top-k/top-p ones stay eager by
    design), and no compiled class may run a graph captured eagerly. Greedy and seeded sampled
    requests get the eager engine's tokens. Batch of one (two classes to compile)."""
    tdir, ddir, model = pair
    jobs = [(p, SamplingParams(**{**vars(sp), "max_tokens": 30})) for p, sp in workload(4, seed=21)]
    cfg = spec(ddir) if drafted else None
    eager, compiled = [], []
    for compile, outs in ((False, eager), (True, compiled)):
        with LLM(str(tdir), speculative_config=cfg, device="cuda", dtype="float32", max_batch_size=1,
                 max_seq_len=128, compile=compile, wedge_timeout_s=None) as llm:  # fmt: skip
            res = llm.generate([p for p, _ in jobs], [sp for _, sp in jobs])
            outs.extend(r.outputs[0].token_ids for r in res)
            executor = llm.engine.executor
            graphs = list(executor._graphs.values())
            assert graphs and not executor._graph_failed
            if compile:  # top-k/top-p requests are a class the warm-up does not compile
                assert executor.rounds is not None, (
                    "compiling the round failed: the engine fell back to eager"
                )
                assert any(g.compiled_fn is not None for g in graphs), "no graph runs a compiled round"
                assert not any(g.stale() for g in graphs), "a compiled class was captured eagerly"
    assert compiled == eager
    assert_greedy_is_plain(model, jobs, compiled)
