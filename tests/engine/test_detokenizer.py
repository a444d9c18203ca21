# SPDX-License-Identifier: Apache-2.0
"""The detokenizer's direct backend decode gives transformers' text, and is used only where it does."""

from __future__ import annotations

import random

import pytest

from dflash_trt.engine.detokenizer import IncrementalDetokenizer, decoder


def _tokenizers():
    from transformers import AutoTokenizer

    from dflash_trt.smollm2 import ensure_smollm2
    from dflash_trt.tiny import build_byte_tokenizer

    return {
        "tiny": build_byte_tokenizer(),
        "smollm2-135m": AutoTokenizer.from_pretrained(ensure_smollm2().target),
    }


@pytest.fixture(scope="module", params=["tiny", "smollm2-135m"])
def tokenizer(request):
    return _tokenizers()[request.param]


@pytest.mark.parametrize("skip", [True, False])
def test_the_direct_decode_equals_transformers_decode(tokenizer, skip):
    fast = decoder(tokenizer, skip_special_tokens=skip)
    assert fast.func == tokenizer.backend_tokenizer.decode  # the fast path is the one under test
    rng = random.Random(0)
    specials, vocab = list(tokenizer.all_special_ids), len(tokenizer)
    for _ in range(300):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(0, 12))]
        ids += rng.sample(specials, k=min(len(specials), rng.randrange(0, 3)))
        rng.shuffle(ids)
        assert fast(ids) == tokenizer.decode(ids, skip_special_tokens=skip), ids


def test_a_tokenizer_that_cleans_up_spaces_decodes_through_transformers(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    assert decoder(tokenizer, skip_special_tokens=True).func == tokenizer.decode


def test_streamed_text_equals_the_whole_decode(tokenizer):
    """Multi-byte characters split across tokens come out whole, in order, once."""
    text = "Grüße, 世界! naïve café — ok 🙂\n  def f(x):\n\treturn x"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    rng = random.Random(1)
    pieces, i = [], 0
    while i < len(ids):
        n = rng.randrange(1, 5)
        pieces.append(detok.add(ids[i : i + n]))
        i += n
    pieces.append(detok.flush())
    assert "".join(pieces) == detok.text == tokenizer.decode(ids, skip_special_tokens=True)
