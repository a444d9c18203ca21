# SPDX-License-Identifier: Apache-2.0
"""Penalties, logit bias and min-p under DFlash (spec/penalties.py): greedy DFlash equals greedy plain
decoding and a from-scratch loop that applies the rules token by token; sampled DFlash keeps the
penalized distribution (chi-square against enumeration); bad values are refused by field."""

from __future__ import annotations

import itertools

import pytest
import torch

from dflash_trt import LLM, SamplingParams
from dflash_trt.engine.assemble import build_engine
from dflash_trt.engine.config import EngineConfig
from dflash_trt.engine.request import RequestParams
from dflash_trt.errors import RequestError
from dflash_trt.models.checkpoint import save_drafter
from dflash_trt.spec.decoding_config import DFlashDecodingConfig
from tests.conftest import make_drafter, make_target
from tests.test_sampling import chi_square_p

BLOCK = 5
CASES = [
    {"repetition_penalty": 2.0},
    {"frequency_penalty": 0.7},
    {"presence_penalty": 1.2},
    {"logit_bias": ((32, 2.5), (101, -4.0))},
    {
        "repetition_penalty": 0.8,
        "frequency_penalty": -0.5,
        "presence_penalty": 0.4,
        "logit_bias": ((10, 1.0),),
    },
]


def penalized(logits: list[float], prompt: list[int], out: list[int], p: dict) -> list[float]:
    """The module's rules written out token by token (the test's own reading of spec/penalties.py)."""
    scores = list(logits)
    r = p.get("repetition_penalty", 1.0)
    for t in set(prompt) | set(out):
        scores[t] = scores[t] / r if scores[t] > 0 else scores[t] * r
    for t in set(out):
        scores[t] -= p.get("frequency_penalty", 0.0) * out.count(t) + p.get("presence_penalty", 0.0)
    for t, b in p.get("logit_bias", ()):
        scores[t] += b
    return scores


def reference_greedy(model, prompt: list[int], steps: int, p: dict) -> list[int]:
    out: list[int] = []
    for _ in range(steps):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, -1].tolist()
        scores = penalized(logits, prompt, out, p)
        out.append(max(range(len(scores)), key=lambda t: (scores[t], -t)))
    return out


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("penalties")
    target = make_target("qwen3", seed=7, vocab=8, layers=2)
    target.save_pretrained(root / "target")
    save_drafter(make_drafter(target, block_size=BLOCK, seed=8, std=0.5), root / "drafter")
    return root / "target", root / "drafter", target


@pytest.fixture(scope="module")
def tiny():
    """The shipped pair (its drafter agrees with its target: rounds accept drafts) and its target in
    transformers, float32."""
    from transformers import AutoModelForCausalLM

    from dflash_trt.tiny import ensure_tiny

    paths = ensure_tiny()
    model = AutoModelForCausalLM.from_pretrained(paths.target, dtype=torch.float32).eval()
    return paths.target, paths.drafter, model


def engine_for(
    tdir, ddir, *, batch: int = 4, static: bool = False, seq: int = 64, block: int = BLOCK, tree: int = 0
):
    spec = DFlashDecodingConfig(max_draft_len=block - 1, tree_budget=tree) if ddir is not None else None
    return build_engine(target_dir=tdir, drafter_dir=ddir, spec=spec, tokenizer=None,
                        config=EngineConfig(max_batch_size=batch, max_seq_len=seq, static_rounds=static, compile=False),
                        device=torch.device("cpu"), dtype=torch.float32)  # fmt: skip


def run(engine, jobs: list[tuple[list[int], RequestParams]]) -> list:
    reqs = [engine.add_request(prompt, params) for prompt, params in jobs]
    while engine.has_work():
        engine.step()
    return reqs


@pytest.mark.parametrize(
    ("variant", "static"), [("v1", False), ("v1", True), ("dflash2", False), ("tree", False)]
)
def test_greedy_dflash_with_penalties_equals_plain_and_the_rules(tiny, variant, static):
    """Each option alone and all together, batched with a request without any (their rows share rounds):
    DFlash (eager and padded static rounds; DFlash 2; a DDTree engine, whose penalized batches verify the
    chain) == plain decoding == the token-by-token loop, on `tiny`."""
    from dflash_trt.tiny import build_byte_tokenizer, ensure_tiny, heldout_prompts

    tdir, ddir, model = tiny
    ddir = ensure_tiny().drafter_dflash2 if variant == "dflash2" else ddir
    tok = build_byte_tokenizer()
    prompts = [tok.encode(t)[:40] for t in heldout_prompts()[:3]]
    jobs = [(pr, RequestParams(max_tokens=24, ignore_eos=True, **case)) for case in CASES for pr in prompts]
    jobs.append((prompts[0], RequestParams(max_tokens=24, ignore_eos=True)))  # no penalty, same batches
    dflash = run(
        engine_for(tdir, ddir, static=static, block=16, seq=160, tree=12 if variant == "tree" else 0), jobs
    )
    plain = run(engine_for(tdir, None, seq=128), jobs)
    for (prompt, params), d, a in zip(jobs, dflash, plain):
        case = {k: getattr(params, k) for k in ("repetition_penalty", "frequency_penalty", "presence_penalty",
                                                 "logit_bias")}  # fmt: skip
        want = reference_greedy(model, prompt, 24, case)
        assert a.output_ids == want, case
        assert d.output_ids == want, case
    free = [reference_greedy(model, pr, 24, {}) for pr in prompts]  # each option changes some output
    for i, case in enumerate(CASES):
        assert [d.output_ids for d in dflash[i * len(prompts) : (i + 1) * len(prompts)]] != free, case
    assert sum(r.num_accepted_draft_tokens for r in dflash) > 100, "drafts were almost never accepted"


def test_a_reused_row_forgets_its_last_owners_bias(pair):
    """One batch row: a request with a strong bias, then one without, in the same engine."""
    tdir, ddir, model = pair
    engine = engine_for(tdir, ddir, batch=1)
    biased, free = run(engine, [([1, 2, 3], RequestParams(max_tokens=8, ignore_eos=True, logit_bias=((4, 50.0),))),
                                ([1, 2, 3], RequestParams(max_tokens=8, ignore_eos=True))])  # fmt: skip
    assert biased.output_ids == [4] * 8
    assert free.output_ids == reference_greedy(model, [1, 2, 3], 8, {})


def exact_joint(
    model, prompt: list[int], temperature: float, p: dict, min_p: float, steps: int
) -> torch.Tensor:
    """p(t1..t_steps | prompt) under penalized sampling, by enumeration: [V] * steps."""
    vocab = model.config.vocab_size
    out = torch.zeros((vocab,) * steps, dtype=torch.float64)
    for seq in itertools.product(range(vocab), repeat=steps):
        prob = 1.0
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(seq[:-1])])).logits[0, len(prompt) - 1 :]
        for i, tok in enumerate(seq):
            scores = torch.tensor(
                penalized(logits[i].tolist(), prompt, list(seq[:i]), p), dtype=torch.float64
            )
            probs = torch.softmax(scores / temperature, dim=-1)
            probs = torch.where(probs < min_p * probs.max(), 0.0, probs)
            prob *= float(probs[tok] / probs.sum())
        out[seq] = prob
    return out


@pytest.mark.slow
def test_sampled_dflash_keeps_the_penalized_distribution(tmp_path):
    """1,500 seeds of one prompt (prefill token + one round of 2 drafts, static padded rounds) with every
    option at once: the joint distribution of the 3 tokens is the penalized target's."""
    target = make_target("qwen3", seed=5, vocab=5, layers=4)
    target.save_pretrained(tmp_path / "target")
    save_drafter(make_drafter(target, block_size=3, std=0.6, seed=3), tmp_path / "drafter")
    engine = build_engine(
        target_dir=tmp_path / "target", drafter_dir=tmp_path / "drafter", spec=DFlashDecodingConfig(max_draft_len=2),
        tokenizer=None, config=EngineConfig(max_batch_size=64, max_seq_len=16, static_rounds=True, compile=False),
        device=torch.device("cpu"), dtype=torch.float32,
    )  # fmt: skip
    case = {
        "repetition_penalty": 1.4,
        "frequency_penalty": 0.5,
        "presence_penalty": 0.3,
        "logit_bias": ((2, 0.8),),
    }
    prompt, runs, temperature, min_p = [1, 3, 2], 1500, 0.9, 0.08
    jobs = [(prompt, RequestParams(max_tokens=3, temperature=temperature, seed=s, ignore_eos=True, min_p=min_p, **case))
            for s in range(runs)]  # fmt: skip
    reqs = run(engine, jobs)
    counts = torch.zeros((5, 5, 5), dtype=torch.float64)
    for req in reqs:
        counts[tuple(req.output_ids)] += 1
    assert sum(r.num_accepted_draft_tokens for r in reqs) / (2 * runs) > 0.05, (
        "drafts were almost never accepted"
    )
    assert chi_square_p(counts, exact_joint(target, prompt, temperature, case, min_p, steps=3)) > 1e-3


@pytest.mark.parametrize(
    ("field", "params"),
    [
        ("presence_penalty", {"presence_penalty": 2.5}),
        ("frequency_penalty", {"frequency_penalty": float("nan")}),
        ("repetition_penalty", {"repetition_penalty": 0.0}),
        ("min_p", {"min_p": 1.5}),
        ("logit_bias", {"logit_bias": ((8, 1.0),)}),
        ("logit_bias", {"logit_bias": ((3, 101.0),)}),
    ],
)
def test_out_of_range_values_are_refused_by_field(pair, field, params):
    tdir, ddir, _ = pair
    with pytest.raises(RequestError) as err:
        engine_for(tdir, ddir).add_request([1, 2], RequestParams(max_tokens=4, **params))
    assert err.value.field == field


def test_the_llm_api_takes_penalties_bias_and_min_p(pair):
    """SamplingParams' names through LLM.generate, DFlash and plain alike; a +100 bias forces its token."""
    tdir, ddir, model = pair
    spec = {"decoding_type": "DFlash", "max_draft_len": BLOCK - 1, "speculative_model": str(ddir)}
    sps = [SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.5),
           SamplingParams(max_tokens=6, ignore_eos=True, logit_bias={6: 100.0}),
           SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.7, min_p=0.2, seed=1)]  # fmt: skip
    outs = []
    for cfg in (spec, None):
        with LLM(str(tdir), speculative_config=cfg, max_batch_size=4, max_seq_len=64, compile=False) as llm:
            outs.append([o.outputs[0].token_ids for o in llm.generate([[3, 1, 4]] * 3, sps)])
    assert outs[0][:2] == outs[1][:2]
    assert outs[0][0] == reference_greedy(
        model, [3, 1, 4], 12, {"repetition_penalty": 1.3, "presence_penalty": 0.5}
    )
    assert outs[0][1] == [6] * 6


def reference_banned(model, prompt: list[int], steps: int, words: tuple[tuple[int, ...], ...]) -> list[int]:
    """Greedy decoding that bans each word's last token wherever the sequence ends with its others."""
    out: list[int] = []
    for _ in range(steps):
        with torch.no_grad():
            scores = model(torch.tensor([prompt + out])).logits[0, -1].tolist()
        seq = prompt + out
        for w in words:
            if len(w) == 1 or seq[len(seq) - len(w) + 1 :] == list(w[:-1]):
                scores[w[-1]] = float("-inf")
        out.append(max(range(len(scores)), key=lambda t: (scores[t], -t)))
    return out


def contains(seq: list[int], word: tuple[int, ...]) -> bool:
    return any(tuple(seq[i : i + len(word)]) == word for i in range(len(seq) - len(word) + 1))


@pytest.mark.parametrize(
    ("variant", "static"),
    [("v1", False), ("v1", True), ("dflash2", False), ("tree", False), ("plain", False)],
)
def test_bad_words_are_never_generated_and_dflash_equals_the_loop(tiny, variant, static):
    """Words of one, two and three tokens taken from the free greedy output: DFlash (eager, static,
    DFlash 2, DDTree) and plain decoding equal the loop that bans them, and none of them appears; sampled
    requests never emit them either."""
    from dflash_trt.tiny import build_byte_tokenizer, ensure_tiny, heldout_prompts

    tdir, ddir, model = tiny
    ddir = {"dflash2": ensure_tiny().drafter_dflash2, "plain": None}.get(variant, ddir)
    prompts = [build_byte_tokenizer().encode(t)[:40] for t in heldout_prompts()[:3]]
    jobs, words = [], []
    for pr in prompts:
        free = reference_banned(model, pr, 24, ())
        w = ((free[2],), (free[6], free[7]), (free[12], free[13], free[14]))
        words.append(w)
        jobs.append((pr, RequestParams(max_tokens=24, ignore_eos=True, bad_words=w)))
        jobs.append((pr, RequestParams(max_tokens=24, ignore_eos=True, temperature=1.0, seed=5, bad_words=w)))
    engine = engine_for(tdir, ddir, static=static, block=16, seq=160, tree=12 if variant == "tree" else 0)
    reqs = run(engine, jobs)
    for i, pr in enumerate(prompts):
        greedy, sampled = reqs[2 * i], reqs[2 * i + 1]
        assert greedy.output_ids == reference_banned(model, pr, 24, words[i])
        for out in (greedy.output_ids, sampled.output_ids):
            assert not any(contains(pr[-2:] + out, w) for w in words[i]), (variant, words[i], out)
    if ddir is not None:
        assert sum(r.num_accepted_draft_tokens for r in reqs) > 20, "drafts were almost never accepted"


@pytest.mark.parametrize(
    ("words", "pattern"),
    [(((1,) * 17,), r"a word must be 1 to 16 tokens"), (((999,),), r"out of range for vocab_size"),
     (((),), r"a word must be 1 to 16 tokens"), (((1,),) * 257, r"more than 256 words")],
)  # fmt: skip
def test_bad_words_out_of_range_are_refused_by_field(pair, words, pattern):
    tdir, ddir, _ = pair
    engine = engine_for(tdir, ddir, batch=1)
    with pytest.raises(RequestError, match=pattern) as info:
        engine.add_request([1, 2, 3], RequestParams(max_tokens=4, bad_words=words))
    assert info.value.field == "bad_words"


def test_bad_strings_through_the_llm_api():
    """`bad` strings are tokenized alone; `bad_token_ids` are one-token words; greedy text avoids them."""
    with LLM("tiny", max_batch_size=1, compile=False) as llm:
        prompt = "class Foo:\n    def "  # greedy: "__init__(self, ..."
        free = llm.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True)).outputs[0].text
        out = llm.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True, bad=["init"],
                                                  bad_token_ids=[ord("(")])).outputs[0]  # fmt: skip
        assert "init" in free and "(" in free
        assert "init" not in out.text and "(" not in out.text and out.text != free
