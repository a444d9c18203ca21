# SPDX-License-Identifier: Apache-2.0
"""Guided decoding under DFlash (engine/grammar.py): greedy guided DFlash (linear, static rounds, DDTree,
DFlash 2) equals greedy guided plain decoding token for token, and its output is in the guide's language;
guided and free requests share a batch; sampled guided DFlash keeps the masked distribution (chi-square
against enumeration with xgrammar's own matcher); bad guides and conflicting options are refused by field.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from dflash_trt.engine.assemble import build_engine
from dflash_trt.engine.config import EngineConfig
from dflash_trt.engine.request import RequestParams
from dflash_trt.errors import RequestError
from dflash_trt.models.checkpoint import save_drafter
from dflash_trt.spec.decoding_config import DFlashDecodingConfig
from tests.conftest import make_drafter, make_target
from tests.test_sampling import chi_square_p

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "size": {"type": "integer"},
                   "tags": {"type": "array", "items": {"enum": ["def", "class", "self"]}, "maxItems": 3}},
    "required": ["name", "size", "tags"],
    "additionalProperties": False,
}  # fmt: skip
REGEX = r"def [a-z_]{1,12}\((self|cls)?\):"
GUIDES = [("json_schema", json.dumps(SCHEMA)), ("regex", REGEX), ("json", ""),
          ("ebnf_grammar", 'root ::= "return " [a-z]+ ("." [a-z]+)*')]  # fmt: skip


@pytest.fixture(scope="module")
def tiny():
    from dflash_trt.tiny import build_byte_tokenizer, ensure_tiny, heldout_prompts

    tok = build_byte_tokenizer()
    return ensure_tiny(), tok, [tok.encode(t)[:48] for t in heldout_prompts()[:3]]


def engine_for(paths, tok, *, draft="v1", static=False, tree=0, backend="xgrammar"):
    drafter = {"v1": paths.drafter, "v2": paths.drafter_dflash2, None: None}[draft]
    spec = DFlashDecodingConfig(max_draft_len=15, tree_budget=tree) if draft else None
    config = EngineConfig(max_batch_size=8, max_seq_len=256, static_rounds=static, compile=False,
                          guided_decoding_backend=backend)  # fmt: skip
    return build_engine(target_dir=paths.target, drafter_dir=drafter, spec=spec, tokenizer=tok, config=config,
                        device=torch.device("cpu"), dtype=torch.float32, eos_token_ids=(tok.eos_token_id,))  # fmt: skip


def run(engine, jobs):
    reqs = [engine.add_request(prompt, params) for prompt, params in jobs]
    while engine.has_work():
        engine.step()
    return reqs


def check_language(kind: str, text: str, tok) -> None:
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json":
        json.loads(text)  # any JSON value (TensorRT-LLM's json guide)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert re.fullmatch(r"return [a-z]+(\.[a-z]+)*", text), text


@pytest.mark.parametrize(("draft", "static", "tree"), [("v1", False, 0), ("v1", True, 0), ("v1", False, 15),
                                                       ("v2", False, 0)])  # fmt: skip
def test_greedy_guided_dflash_equals_greedy_guided_plain_decoding(tiny, draft, static, tree):
    paths, tok, prompts = tiny
    jobs = [(p, RequestParams(max_tokens=96, guide=guide)) for p in prompts[:2] for guide in GUIDES]
    plain = run(engine_for(paths, tok, draft=None), jobs)
    spec = run(engine_for(paths, tok, draft=draft, static=static, tree=tree), jobs)
    for (_, params), a, b in zip(jobs, plain, spec, strict=True):
        assert b.output_ids == a.output_ids
        if a.finish_reason == "stop":  # ended by its guide: the text is in the guide's language
            check_language(params.guide[0], b.text, tok)
    assert sum(r.finish_reason == "stop" for r in spec) >= len(jobs) // 2
    assert sum(r.num_accepted_draft_tokens for r in spec) > 0


def test_drafts_are_masked_so_acceptance_survives(tiny):
    """Masked drafts: under a JSON schema, tau stays well above 1 (without the drafts' mask most drafts
    fall outside the guide and are refused)."""
    paths, tok, prompts = tiny
    jobs = [(p, RequestParams(max_tokens=96, guide=GUIDES[0])) for p in prompts]
    reqs = run(engine_for(paths, tok), jobs)
    tokens = sum(len(r.output_ids) - 1 for r in reqs)
    rounds = sum(len(r.acceptance_lengths) for r in reqs)
    assert tokens / rounds > 1.5


def test_guided_and_free_requests_share_a_batch(tiny):
    paths, tok, prompts = tiny
    free = [(p, RequestParams(max_tokens=40)) for p in prompts]
    guided = [(p, RequestParams(max_tokens=40, guide=GUIDES[1])) for p in prompts]
    engine = engine_for(paths, tok)
    alone = run(engine_for(paths, tok), free)
    mixed = run(engine, [j for pair in zip(free, guided) for j in pair])
    assert [r.output_ids for r in mixed[0::2]] == [r.output_ids for r in alone]
    assert all(re.fullmatch(REGEX, r.text) or r.finish_reason == "length" for r in mixed[1::2])
    assert engine.stats()["peak_active"] >= 2


@pytest.mark.parametrize(
    ("field", "params"),
    [
        ("guided_decoding", {"guide": ("json_schema", '{"type": "object", "properties": 3}')}),
        ("guided_decoding", {"guide": ("json_schema", "not json")}),
        ("guided_decoding", {"guide": ("regex", "(unclosed")}),
        ("guided_decoding", {"guide": ("ebnf_grammar", "root ::= ")}),
        ("guided_decoding", {"guide": ("yaml", "a: b")}),
        ("ignore_eos", {"guide": ("json", ""), "ignore_eos": True}),
        ("min_tokens", {"guide": ("json", ""), "min_tokens": 3}),
    ],
)
def test_bad_guides_are_refused_by_field(tiny, field, params):
    paths, tok, prompts = tiny
    with pytest.raises(RequestError) as err:
        engine_for(paths, tok, draft=None).add_request(prompts[0], RequestParams(max_tokens=4, **params))
    assert err.value.field == field
    assert "\n" not in str(err.value)


def test_an_engine_without_a_backend_refuses_guides(tiny):
    paths, tok, prompts = tiny
    with pytest.raises(RequestError, match="guided_decoding_backend='xgrammar'") as err:
        engine_for(paths, tok, draft=None, backend=None).add_request(
            prompts[0], RequestParams(max_tokens=4, guide=("json", ""))
        )
    assert err.value.field == "guided_decoding"


# --- sampling: the masked distribution, enumerated ------------------------------------------------
LETTERS = ("a", "b", "c", "d")  # ids 0..3; 4 is the end id


def letters_tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(LETTERS)} | {"</s>": 4}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="</s>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")


def exact_masked(target, tok, prompt, temperature, regex, steps):
    """Every output of up to `steps` tokens and its probability: the target's tempered softmax over the
    tokens xgrammar's matcher allows after the output so far (an end id ends the output)."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=5, stop_token_ids=[4])
    compiled = xgr.GrammarCompiler(info).compile_regex(regex)
    probs: dict[tuple[int, ...], float] = {}

    def walk(out, p):
        if len(out) == steps or (out and out[-1] == 4):
            probs[tuple(out)] = probs.get(tuple(out), 0.0) + p
            return
        matcher = xgr.GrammarMatcher(compiled)
        for t in out:
            assert matcher.accept_token(t)
        mask = xgr.allocate_token_bitmask(1, 5)
        matcher.fill_next_token_bitmask(mask)
        allowed = [(int(mask[0, 0]) >> t) & 1 for t in range(5)]
        with torch.no_grad():
            logits = target(torch.tensor([prompt + out])).logits[0, -1].double() / temperature
        logits[torch.tensor(allowed) == 0] = float("-inf")
        for t, q in enumerate(torch.softmax(logits, -1).tolist()):
            if q > 0:
                walk([*out, t], p * q)

    walk([], 1.0)
    return probs


@pytest.mark.parametrize("tree", [0, 4])
def test_sampled_guided_dflash_keeps_the_masked_distribution(tmp_path, tree):
    """1,500 seeds of one prompt, prefill token + one round of 2 drafts (linear, or a DDTree of 4 nodes):
    the outputs are distributed as the target's distribution masked by the guide at every position."""
    target = make_target("qwen3", seed=5, vocab=5, layers=4)
    target.save_pretrained(tmp_path / "target")
    save_drafter(make_drafter(target, block_size=3, std=0.6, seed=3), tmp_path / "drafter")
    tok = letters_tokenizer()
    engine = build_engine(
        target_dir=tmp_path / "target", drafter_dir=tmp_path / "drafter",
        spec=DFlashDecodingConfig(max_draft_len=2, tree_budget=tree),
        tokenizer=tok, config=EngineConfig(max_batch_size=64, max_seq_len=16, static_rounds=not tree, compile=False,
                                           guided_decoding_backend="xgrammar"),
        device=torch.device("cpu"), dtype=torch.float32, eos_token_ids=(4,),
    )  # fmt: skip
    prompt, runs, temperature, regex = [1, 3, 2], 1500, 0.9, "[ab]+c?|d[ac]+"
    jobs = [(prompt, RequestParams(max_tokens=3, temperature=temperature, seed=s, guide=("regex", regex)))
            for s in range(runs)]  # fmt: skip
    reqs = run(engine, jobs)
    exact = exact_masked(target, tok, prompt, temperature, regex, steps=3)
    outcomes = sorted(exact)
    counts = torch.zeros(len(outcomes), dtype=torch.float64)
    for req in reqs:
        counts[outcomes.index(tuple(req.output_ids))] += 1
    assert sum(r.num_accepted_draft_tokens for r in reqs) / (2 * runs) > 0.05, (
        "drafts were almost never accepted"
    )
    assert chi_square_p(counts, torch.tensor([exact[o] for o in outcomes], dtype=torch.float64)) > 1e-3


def test_llm_api_guided_decoding_params(tiny):
    """TensorRT-LLM's surface: LLM(guided_decoding_backend='xgrammar') and SamplingParams.guided_decoding;
    a schema given as a dict; two guides at once refused by field; and without the backend, refused."""
    from dflash_trt import LLM, GuidedDecodingParams, SamplingParams

    paths, _, _ = tiny
    spec = {"decoding_type": "DFlash", "max_draft_len": 15, "speculative_model": str(paths.drafter)}
    llm = LLM(str(paths.target), speculative_config=spec, compile=False, guided_decoding_backend="xgrammar")
    try:
        out = llm.generate(
            "def parse(", SamplingParams(max_tokens=96, guided_decoding=GuidedDecodingParams(json=SCHEMA))
        )
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
        with pytest.raises(RequestError) as err:
            llm.generate(
                "x", SamplingParams(guided_decoding=GuidedDecodingParams(regex="a", grammar='root ::= "a"'))
            )
        assert err.value.field == "guided_decoding"
    finally:
        llm.shutdown()


def test_each_of_n_sequences_has_its_own_guide(tiny):
    """n > 1: the siblings copy the leader's prompt pages but not its matcher: each sequence is guided
    from the start and equals a separate request with its seed (sampled: the sequences differ)."""
    from dflash_trt.engine.admission import sequence_seed

    paths, tok, prompts = tiny
    case = {"temperature": 0.9, "seed": 21, "guide": ("regex", REGEX)}
    engine = engine_for(paths, tok)
    group = engine.add_request(prompts[0], RequestParams(max_tokens=48, n=3, **case)).group  # before the fork
    while engine.has_work():
        engine.step()
    singles = [
        (prompts[0], RequestParams(max_tokens=48, **{**case, "seed": sequence_seed(21, i)})) for i in range(3)
    ]
    alone = run(engine_for(paths, tok), singles)
    assert len(group) == 3
    for got, want in zip(group, alone, strict=True):
        assert got.output_ids == want.output_ids
        assert got.finish_reason != "stop" or re.fullmatch(REGEX, got.text), got.text
    assert len({tuple(r.output_ids) for r in group}) > 1
