# SPDX-License-Identifier: Apache-2.0
"""DFlash 2 drafters in the embedded engine: the candidate selector proposes the drafts in the batched
round (eager, static padded and compiled rounds; PyTorch path and dflash:: ops), and every request equals
the batch-1 reference loop round by round (same tokens, same acceptance lengths, same overturned picks);
greedy output equals plain decoding; sampling preserves the target's distribution (chi-square); a ragged
batch never lets one request's block reach another's."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from dflash_trt import LLM, SamplingParams
from dflash_trt.engine import round as round_mod
from dflash_trt.engine.assemble import build_engine
from dflash_trt.engine.config import EngineConfig
from dflash_trt.engine.request import RequestParams
from dflash_trt.models.checkpoint import load_drafter, save_drafter
from dflash_trt.reference.generate import spec_generate
from dflash_trt.reference.hf_target import HFTarget
from dflash_trt.spec.decoding_config import DFlashDecodingConfig
from dflash_trt.spec.sampling import SamplingConfig
from tests.conftest import make_drafter, make_target
from tests.test_dflash2 import SAMPLING_CASES
from tests.test_sampling import chi_square_p, exact_joint

BLOCK = 6


def strong_selector(drafter, scale: float):
    """Scale the successor codebook so the pair scores often outweigh the unary ones (overturned picks)."""
    with torch.no_grad():
        drafter.selector.successor_codebook.mul_(scale)
    return drafter


@pytest.fixture(scope="module")
def random_pairs(tmp_path_factory):
    """variant -> (target dir, DFlash 2 drafter dir, target model): a small-vocabulary target and random
    DFlash 2 drafters (full layers; sliding-window layers) it often agrees with."""
    made = {}

    def get(variant: str = "plain"):
        if variant not in made:
            root = tmp_path_factory.mktemp(f"dflash2-{variant}")
            target = make_target("qwen3", seed=31, vocab=13)
            target.save_pretrained(root / "target")
            extra = {"variant": "swa"} if variant == "swa" else {}
            drafter = make_drafter(target, block_size=BLOCK, seed=32, std=0.5, dflash2=True, **extra)
            save_drafter(strong_selector(drafter, 6.0), root / "drafter")
            made[variant] = (root / "target", root / "drafter", target)
        return made[variant]

    return get


@pytest.fixture(scope="module")
def tiny_pair():
    """The shipped tiny target (transformers, float32) and its trained DFlash 2 drafter."""
    from transformers import AutoModelForCausalLM

    from dflash_trt.tiny import ensure_tiny

    paths = ensure_tiny()
    model = AutoModelForCausalLM.from_pretrained(paths.target, dtype=torch.float32).eval()
    return paths.target, paths.drafter_dflash2, model


def workload(n: int, seed: int, *, vocab: int = 12, lengths=(1, 30), tokens=(3, 40)):
    """Mixed requests: greedy, seeded T = 0.8, seeded T = 1.2 with top-k and top-p; ragged lengths."""
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(*lengths))]
        kind, max_tokens = i % 3, rng.randint(*tokens)
        if kind == 0:
            sp = SamplingParams(max_tokens=max_tokens)
        elif kind == 1:
            sp = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=1000 + i)
        else:
            sp = SamplingParams(max_tokens=max_tokens, temperature=1.2, top_k=6, top_p=0.9, seed=2000 + i)
        jobs.append((prompt, SamplingParams(**{**vars(sp), "return_perf_metrics": True, "ignore_eos": True})))
    return jobs


def reference(model, drafter, prompt, sp: SamplingParams, block: int):
    temperature = sp.temperature or 0.0
    cfg = SamplingConfig(temperature=temperature, top_k=sp.top_k or 0, top_p=sp.top_p or 1.0, seed=sp.seed)
    return spec_generate(
        HFTarget(model), drafter, prompt, max_new_tokens=sp.max_tokens, sampling=cfg, block_size=block
    )


def run_llm(tdir, ddir, jobs, *, block: int, static_rounds=False, compile=False, use_plugins=False,
            max_batch_size=4, spy=None):  # fmt: skip
    # the full block at every batch size, as the reference loop drafts it (round-by-round parity)
    spec = {"decoding_type": "DFlash", "max_draft_len": block - 1, "speculative_model": str(ddir),
            "max_concurrency": max_batch_size}  # fmt: skip
    llm = LLM(str(tdir), speculative_config=spec, max_batch_size=max_batch_size, max_num_tokens=64,
              max_seq_len=256, dtype="float32", compile=compile, use_plugins=use_plugins)  # fmt: skip
    engine = llm.engine
    assert engine.drafter is not None and engine.drafter.selector is not None
    if static_rounds:  # padded static buffers: what a CUDA graph captures
        engine.executor.static_rounds = True
        engine.executor.graph_batch_sizes = (3, max_batch_size)
    if spy is not None:
        spy(engine)
    try:
        outs = llm.generate([p for p, _ in jobs], [sp for _, sp in jobs])
    finally:
        llm.shutdown()
    return [o.outputs[0] for o in outs]


def assert_equals_reference(outs, jobs, model, ddir, block: int) -> tuple[int, int]:
    """Every request equals the batch-1 reference loop: tokens, per-round acceptance lengths, accepted
    and overturned drafts; greedy ones equal plain decoding too. Returns (accepted, overturned) totals."""
    drafter = load_drafter(ddir, dtype=torch.float32)
    accepted = overturned = 0
    for (prompt, sp), out in zip(jobs, outs):
        ref = reference(model, drafter, prompt, sp, block)
        m = out.request_perf_metrics.speculative_decoding
        assert out.token_ids == ref.output_ids, (prompt, sp)
        assert m.acceptance_lengths == ref.acceptance_lengths, (prompt, sp)
        assert m.total_accepted_draft_tokens == ref.num_accepted_draft_tokens
        assert m.total_draft_tokens == ref.num_draft_tokens
        assert m.total_overturned_draft_tokens == ref.num_overturned, (prompt, sp)
        if not sp.temperature:
            assert out.token_ids == reference(model, None, prompt, sp, 1).output_ids
        accepted += m.total_accepted_draft_tokens
        overturned += m.total_overturned_draft_tokens
    return accepted, overturned


@pytest.mark.parametrize("static_rounds", [False, True], ids=["eager", "static-padded"])
def test_tiny_dflash2_engine_equals_reference_round_by_round(tiny_pair, static_rounds):
    """The shipped, trained tiny DFlash 2 drafter (its selector overturns the drafter's argmax in a real
    share of slots) in mixed batches of greedy and sampled requests joining and leaving."""
    from dflash_trt.models.sources import load_tokenizer
    from dflash_trt.tiny import heldout_prompts

    tdir, ddir, model = tiny_pair
    tokenizer = load_tokenizer(tdir)
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in heldout_prompts()[:6]]
    jobs = [(p, sp) for p, (_, sp) in zip(prompts, workload(6, seed=4, tokens=(24, 56)))]
    outs = run_llm(tdir, ddir, jobs, block=16, static_rounds=static_rounds)
    accepted, overturned = assert_equals_reference(outs, jobs, model, ddir, 16)
    drafted = sum(o.request_perf_metrics.speculative_decoding.total_draft_tokens for o in outs)
    assert accepted > 60, "drafts were rarely accepted: the comparison has no teeth"
    assert overturned > 0.05 * drafted, f"the trained selector overturned {overturned} of {drafted} slots"


@pytest.mark.parametrize(
    ("variant", "static_rounds", "use_plugins"),
    [("plain", False, False), ("plain", True, True), ("swa", True, False), ("swa", False, True)],
    ids=["eager", "static-plugins", "swa-static", "swa-plugins"],
)
def test_random_dflash2_engine_equals_reference_round_by_round(
    random_pairs, variant, static_rounds, use_plugins
):
    """Random DFlash 2 drafters (full and sliding-window layers), 18 mixed requests through 4 batch rows,
    on the PyTorch path and on the dflash:: ops (whose walk and conv must then be the ones that ran)."""
    tdir, ddir, model = random_pairs(variant)
    jobs = workload(18, seed=11)
    calls: list[str] = []

    def spy(engine):
        if use_plugins:
            backend = engine.parts.backend
            assert backend.plugins
            walk = backend.walk

            def counted(*args):
                calls.append("selector_walk")
                return walk(*args)

            engine.parts.backend = dataclasses.replace(backend, walk=counted)

    outs = run_llm(
        tdir, ddir, jobs, block=BLOCK, static_rounds=static_rounds, use_plugins=use_plugins, spy=spy
    )
    accepted, overturned = assert_equals_reference(outs, jobs, model, ddir, BLOCK)
    assert accepted > 20 and overturned > 20, (accepted, overturned)
    assert bool(calls) == use_plugins


@pytest.mark.slow  # ~35 s with a warm compile cache, ~2 min cold
def test_compiled_dflash2_round_equals_reference(random_pairs):
    """A torch.compile'd round (inductor, the CPU default) with the selector's greedy and sampled walk and
    the acceptance over candidates: one compilation (a greedy and a sampled request, batched); every
    request equals the reference round by round. The rounds run from padded static buffers, the path
    a CUDA graph captures: it must run the compiled round too."""
    from torch._dynamo.utils import counters

    from dflash_trt.engine.compile import use_cache_root

    use_cache_root(None, torch.device("cpu"))  # as LLM does: a warm cache makes this seconds of tracing
    tdir, ddir, model = random_pairs("plain")
    engine = build_engine(
        target_dir=tdir, drafter_dir=ddir, tokenizer=None,
        spec=DFlashDecodingConfig(max_draft_len=BLOCK - 1, max_concurrency=2),  # the full block, as the reference
        config=EngineConfig(max_batch_size=2, max_seq_len=64), device=torch.device("cpu"), dtype=torch.float32,
    )  # fmt: skip
    engine.executor.enable_compile()
    engine.executor.compile_prefill = False  # this test compiles rounds (the prefill: test_compiled_rounds)
    engine.executor.static_rounds, engine.executor.graph_batch_sizes = True, (1, 2)
    graphs = counters["stats"]["unique_graphs"]
    jobs = [([3, 1, 4, 1, 5], SamplingParams(max_tokens=24, ignore_eos=True)),
            ([2, 7, 1, 8], SamplingParams(max_tokens=24, temperature=0.9, seed=3, ignore_eos=True))]  # fmt: skip
    reqs = [engine.add_request(p, RequestParams(max_tokens=24, temperature=sp.temperature or 0.0, seed=sp.seed,
                                                ignore_eos=True)) for p, sp in jobs]  # fmt: skip
    while engine.has_work():
        engine.step()
        if engine.runner.times.rounds == 1:  # the first round compiled; other shape classes run eagerly
            engine.executor.freeze()
    assert counters["stats"]["unique_graphs"] > graphs, "no round was compiled"
    static = list(engine.executor._graphs.values())
    assert any(s.compiled_fn is not None for s in static), "the static rounds ran eagerly"
    drafter = load_drafter(ddir, dtype=torch.float32)
    for (prompt, sp), req in zip(jobs, reqs):
        ref = reference(model, drafter, prompt, sp, BLOCK)
        assert req.output_ids == ref.output_ids and req.acceptance_lengths == ref.acceptance_lengths
        assert req.num_overturned_draft_tokens == ref.num_overturned
    assert sum(r.num_overturned_draft_tokens for r in reqs) > 0


def test_ragged_batch_keeps_each_request_in_its_own_block(random_pairs, monkeypatch):
    """The drafter's final states of a request (conv taps and attention included) are the same whether
    it runs alone or batched with others whose blocks are cut short (B_i < g + 1) at other rows, in
    eager and padded static rounds: no tap reads across requests."""
    tdir, ddir, _ = random_pairs("plain")
    lone = [([3, 1, 4, 1, 5, 9, 2, 6], SamplingParams(max_tokens=30, ignore_eos=True))]
    others = [([7] * n, SamplingParams(max_tokens=m, ignore_eos=True)) for n, m in ((2, 3), (11, 7), (5, 2))]

    def recorder(into: dict):
        def spy(engine):
            decode_round, select = engine.runner.decode_round, round_mod.select
            current: list = []

            def rounds(reqs, shape):
                current[:] = [r.request_id for r in reqs]
                return decode_round(reqs, shape)

            def selecting(parts, inputs, blk, hidden, logits, sampling):
                for row, rid in enumerate(current):
                    if rid == 0:  # the request under test: its block's states at this anchor
                        into.setdefault(int(blk.pos[row, 0]), hidden[row].clone())
                return select(parts, inputs, blk, hidden, logits, sampling)

            engine.runner.decode_round = rounds
            monkeypatch.setattr(round_mod, "select", selecting)

        return spy

    alone: dict[int, torch.Tensor] = {}
    run_llm(tdir, ddir, lone, block=BLOCK, spy=recorder(alone))
    for static in (False, True):
        batched: dict[int, torch.Tensor] = {}
        run_llm(tdir, ddir, lone + others, block=BLOCK, static_rounds=static, spy=recorder(batched))
        assert batched.keys() == alone.keys() and len(alone) >= 5
        for start, states in alone.items():  # slots past the end of the request's block are never read
            valid = min(BLOCK - 1, 8 + 30 - start - 1)
            torch.testing.assert_close(batched[start][:valid], states[:valid], rtol=1e-5, atol=1e-5)


# --- sampling is lossless -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chi_pair(tmp_path_factory):
    """A 5-token target and a DFlash 2 drafter choosing among 3 candidates with a strong selector."""
    root = tmp_path_factory.mktemp("dflash2-chi")
    target = make_target("qwen3", seed=5, vocab=5, layers=4)
    target.save_pretrained(root / "target")
    drafter = make_drafter(target, block_size=4, std=0.6, seed=3, dflash2={"selector_top_k": 3})
    save_drafter(strong_selector(drafter, 4.0), root / "drafter")
    return root / "target", root / "drafter", target


@SAMPLING_CASES
def test_engine_dflash2_sampling_preserves_target_distribution(chi_pair, sampling):
    """1,500 seeds of one prompt through the batched engine (prefill token + one round of 2 selector
    drafts, 64 requests a round, static padded rounds): the joint distribution of the 3 generated tokens
    is the target's, and the engine's rounds accept drafts and overturn argmax picks."""
    tdir, ddir, target = chi_pair
    engine = build_engine(
        target_dir=tdir, drafter_dir=ddir, spec=DFlashDecodingConfig(max_draft_len=2), tokenizer=None,
        config=EngineConfig(max_batch_size=64, max_seq_len=16, static_rounds=True, compile=False),
        device=torch.device("cpu"), dtype=torch.float32,
    )  # fmt: skip
    prompt, runs = [1, 3, 2], 1500
    reqs = [
        engine.add_request(prompt, RequestParams(
            max_tokens=3, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
            seed=s, greedy_draft=sampling.greedy_draft, ignore_eos=True))
        for s in range(runs)
    ]  # fmt: skip
    while engine.has_work():
        engine.step()
    counts = torch.zeros((5, 5, 5), dtype=torch.float64)
    for req in reqs:
        counts[tuple(req.output_ids)] += 1
    accepted = sum(r.num_accepted_draft_tokens for r in reqs)
    overturned = sum(r.num_overturned_draft_tokens for r in reqs)
    assert accepted / (2 * runs) > 0.05, "drafts were (almost) never accepted: the test proves little"
    assert overturned / (2 * runs) > 0.05, "the selector (almost) never overturned the argmax"
    assert chi_square_p(counts, exact_joint(target, prompt, sampling, steps=3)) > 1e-3


def test_bench_engine_reports_the_overturn_rate(cli):
    """`dflash-trt bench engine --drafter tiny-dflash2`: the drafter's architecture in the configuration,
    tau and the selector's overturn rate per point (0 for the v1 drafter, none for plain decoding)."""
    import json

    args = ["bench", "engine", "--batch-sizes", "2", "--max-tokens", "24", "--json"]
    code, out, err = cli([*args, "--drafter", "tiny-dflash2"])
    assert code == 0, err
    result = json.loads(out)
    assert result["config"]["drafter_architecture"] == "DFlash2DraftModel"
    ar, d2 = result["points"]
    assert ar["overturn_rate"] is None and 0 < d2["overturn_rate"] < 1 and d2["tau"] > 1
    code, out, err = cli([*args, "--modes", "dflash"])
    assert code == 0, err
    result = json.loads(out)
    assert result["config"]["drafter_architecture"] == "DFlashDraftModel"
    assert result["points"][0]["overturn_rate"] == 0.0


def test_llm_takes_tiny_dflash2_by_name_and_the_engine_refuses_it_a_tree(random_pairs):
    """`speculative_model: tiny-dflash2` names the shipped drafter (its selector proposes); a DDTree budget
    with a DFlash 2 drafter is refused by name when the engine loads it (never a silent fallback)."""
    from dflash_trt.errors import ConfigError

    spec = {"decoding_type": "DFlash", "max_draft_len": 15, "speculative_model": "tiny-dflash2"}
    with LLM("tiny", speculative_config=spec, max_batch_size=1) as llm:
        assert llm.engine.drafter.selector is not None
        out = llm.generate(
            "def fib(n):", SamplingParams(max_tokens=32, ignore_eos=True, return_perf_metrics=True)
        )
    assert out.outputs[0].request_perf_metrics.speculative_decoding.total_overturned_draft_tokens > 0
    tdir, ddir, _ = random_pairs("plain")
    with pytest.raises(ConfigError, match=r"tree_budget=8: DDTree verification does not run DFlash 2"):
        build_engine(target_dir=tdir, drafter_dir=ddir, spec=DFlashDecodingConfig(max_draft_len=3, tree_budget=8),
                  tokenizer=None, config=EngineConfig(max_batch_size=1, max_seq_len=64),
                  device=torch.device("cpu"), dtype=torch.float32)  # fmt: skip
