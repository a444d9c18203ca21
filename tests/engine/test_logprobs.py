# SPDX-License-Identifier: Apache-2.0
"""Log-probabilities under DFlash: every output token's, with its rank and the k most likely tokens',
from the verify pass's distribution (accepted drafts and the bonus token alike), equal to plain
decoding's and to the target's own distribution recomputed over the output, penalties included."""

from __future__ import annotations

import math

import pytest
import torch

from dflash_trt import LLM, SamplingParams
from dflash_trt.errors import RequestError

SPEC = {"decoding_type": "DFlash", "max_draft_len": 15, "speculative_model": "tiny"}


@pytest.fixture(scope="module")
def tiny_model():
    from transformers import AutoModelForCausalLM

    from dflash_trt.tiny import ensure_tiny

    return AutoModelForCausalLM.from_pretrained(ensure_tiny().target, dtype=torch.float32).eval()


def recomputed(model, prompt: list[int], out: list[int], penalties: dict | None = None) -> torch.Tensor:
    """log p(token | everything before it) over the output, [n, V], from one forward pass (with the
    penalties applied position by position as spec/penalties.py says)."""
    from dflash_trt.spec.penalties import penalize

    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1].float()
    if penalties:
        vocab = logits.shape[-1]
        rows = []
        for j in range(len(out)):
            counts = torch.zeros(1, vocab)
            for t in out[:j]:
                counts[0, t] += 1
            seen = counts > 0
            seen[0, prompt] = True
            p = [torch.tensor([penalties.get(k, d)]) for k, d in
                 (("repetition_penalty", 1.0), ("frequency_penalty", 0.0), ("presence_penalty", 0.0))]  # fmt: skip
            rows.append(penalize(logits[j : j + 1], counts, seen, torch.zeros(1, vocab), *p))
        logits = torch.cat(rows)
    return torch.log_softmax(logits, dim=-1)


def check(model, prompt_ids: list[int], comp, k: int, penalties: dict | None = None) -> None:
    lsm = recomputed(model, prompt_ids, list(comp.token_ids), penalties)
    assert comp.logprobs is not None and len(comp.logprobs) == len(comp.token_ids)
    for j, (tok, row) in enumerate(zip(comp.token_ids, comp.logprobs)):
        assert abs(row[tok].logprob - float(lsm[j, tok])) < 1e-3, (j, tok)
        assert row[tok].rank == int((lsm[j] > lsm[j, tok]).sum()) + 1
        top = torch.topk(lsm[j], k).indices.tolist()
        assert set(top) <= set(row) and len(row) <= k + 1
        assert all(abs(row[t].logprob - float(lsm[j, t])) < 1e-3 for t in top)
    assert comp.cumulative_logprob == pytest.approx(
        sum(r[t].logprob for t, r in zip(comp.token_ids, comp.logprobs))
    )


def test_dflash_logprobs_equal_plain_decoding_and_the_target(tiny_model):
    """Greedy (plain and penalized) and seeded sampling, batched: DFlash's log-probabilities are the
    target's over the tokens it emitted (1e-3, fp32), and greedy DFlash reports plain decoding's."""
    from dflash_trt.tiny import build_byte_tokenizer, heldout_prompts

    tok = build_byte_tokenizer()
    prompts = [tok.encode(t)[:48] for t in heldout_prompts()[:3]]
    pen = {"presence_penalty": 0.4, "repetition_penalty": 1.2}
    sps = [SamplingParams(max_tokens=40, ignore_eos=True, temperature=0, logprobs=5),
           SamplingParams(max_tokens=40, ignore_eos=True, temperature=0, logprobs=2, **pen),
           SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.8, seed=3, logprobs=0)]  # fmt: skip
    outs = {}
    for name, cfg in (("dflash", SPEC), ("static", SPEC), ("plain", None)):
        with LLM("tiny", speculative_config=cfg, dtype="float32", max_batch_size=3, compile=False) as llm:
            if name == "static":  # padded static buffers: what a CUDA graph captures
                llm.engine.executor.static_rounds, llm.engine.executor.graph_batch_sizes = True, (2, 3)
            outs[name] = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sps)]
    for (p, sp), comp, static in zip(zip(prompts, sps), outs["dflash"], outs["static"]):
        check(tiny_model, p, comp, sp.logprobs, pen if sp.presence_penalty else None)
        check(tiny_model, p, static, sp.logprobs, pen if sp.presence_penalty else None)
    for d, a in zip(outs["dflash"][:2], outs["plain"][:2]):  # greedy: the same tokens, the same numbers
        assert d.token_ids == a.token_ids
        for rd, ra in zip(d.logprobs, a.logprobs):
            assert rd.keys() == ra.keys()
            assert all(abs(rd[t].logprob - ra[t].logprob) < 1e-3 for t in rd)
    assert outs["dflash"][0].logprobs[0][outs["dflash"][0].token_ids[0]].rank == 1  # greedy takes the top


def test_logprobs_follow_stop_strings_and_streaming():
    """A stop string cuts tokens: their log-probabilities go with them; a streamed request's outputs
    carry the log-probabilities of the tokens so far."""
    with LLM("tiny", speculative_config=SPEC, max_batch_size=2, compile=False) as llm:
        out = llm.generate("def add(a, b):", SamplingParams(max_tokens=48, stop=["\n"], logprobs=1)).outputs[
            0
        ]
        assert out.finish_reason == "stop" and len(out.logprobs) == len(out.token_ids)
        assert all(
            not math.isnan(r[t].logprob) and r[t].logprob <= 0 for t, r in zip(out.token_ids, out.logprobs)
        )
        none = llm.generate("def add(a, b):", SamplingParams(max_tokens=4)).outputs[0]
        assert none.logprobs is None and none.cumulative_logprob is None


@pytest.mark.parametrize("value", [21, -1, True, 1.5])
def test_bad_logprobs_are_refused_by_field(value):
    with LLM("tiny", max_batch_size=1, compile=False) as llm:
        with pytest.raises(RequestError) as err:
            llm.generate("x", SamplingParams(max_tokens=2, logprobs=value))
        assert err.value.field == "logprobs"


@pytest.mark.parametrize("draft", [True, False])
def test_prompt_logprobs_are_the_targets_over_the_prompt(tiny_model, draft):
    """prompt_logprobs = k: each prompt token after the first gets the target's raw log-probability and
    rank there, with the k most likely tokens', across prefill chunks (max_num_tokens 16 splits the
    prompt), shared by the n sequences of one request; max_tokens 0 scores the prompt only."""
    from dflash_trt.tiny import build_byte_tokenizer, heldout_prompts

    ids = build_byte_tokenizer().encode(heldout_prompts()[0])[:50]
    with torch.no_grad():
        lsm = torch.log_softmax(tiny_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    kwargs = {"speculative_config": SPEC} if draft else {}
    with LLM("tiny", dtype="float32", max_batch_size=2, max_num_tokens=16, compile=False, **kwargs) as llm:
        scored = llm.generate(ids, SamplingParams(max_tokens=0, prompt_logprobs=3))
        both = llm.generate(ids, SamplingParams(max_tokens=6, n=2, temperature=0.8, prompt_logprobs=0))
    comp = scored.outputs[0]
    assert comp.token_ids == [] and comp.finish_reason == "length" and comp.prompt_logprobs[0] is None
    assert len(comp.prompt_logprobs) == len(ids)
    for p, (tok, row) in enumerate(zip(ids[1:], comp.prompt_logprobs[1:])):
        want = lsm[p]
        assert abs(row[tok].logprob - float(want[tok])) < 1e-3
        assert row[tok].rank == int((want > want[tok]).sum()) + 1
        top = sorted((lp.rank, t) for t, lp in row.items() if lp.rank <= 3)
        assert [t for _, t in top] == want.topk(3).indices.tolist()
    scores = [r[t].logprob for t, r in zip(ids[1:], comp.prompt_logprobs[1:])]
    for c in both.outputs:
        assert len(c.token_ids) == 6 and c.prompt_logprobs[0] is None
        assert [r[t].logprob for t, r in zip(ids[1:], c.prompt_logprobs[1:])] == pytest.approx(
            scores, abs=1e-5
        )


@pytest.mark.parametrize(
    ("kwargs", "field", "pattern"),
    [
        ({"prompt_logprobs": 21}, "prompt_logprobs", r"prompt_logprobs=21 must be an integer in \[0, 20\]"),
        (
            {"max_tokens": 0},
            "max_tokens",
            r"max_tokens=0 must be an integer >= 1.*0 only with prompt_logprobs",
        ),
    ],
)
def test_bad_prompt_logprobs_and_max_tokens_0_are_refused_by_field(kwargs, field, pattern):
    with LLM("tiny", max_batch_size=1, compile=False) as llm:
        with pytest.raises(RequestError, match=pattern) as info:
            llm.generate_async([1, 2, 3], SamplingParams(**kwargs))
        assert info.value.field == field
