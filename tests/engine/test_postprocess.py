# SPDX-License-Identifier: Apache-2.0
"""engine/postprocess.py: a stop string cuts the tokens where the request's own text puts it."""

from __future__ import annotations

import pytest

from dflash_trt.engine.detokenizer import IncrementalDetokenizer
from dflash_trt.engine.postprocess import commit_tokens
from dflash_trt.engine.request import Request


@pytest.fixture(scope="module")
def tokenizer():
    from dflash_trt.tiny import build_byte_tokenizer

    return build_byte_tokenizer()


def _request(tokenizer, prompt: list[int], *, skip_special_tokens: bool) -> Request:
    return Request(
        request_id=0,
        prompt_ids=prompt,
        max_len=len(prompt) + 64,
        temperature=0.0,
        top_k=0,
        top_p=1.0,
        seed=0,
        greedy_draft=False,
        stop_token_ids=frozenset(),
        stop_strings=("STOP",),
        min_tokens=0,
        include_stop_str_in_output=False,
        detokenizer=IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens),
    )


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_stop_string_keeps_the_tokens_up_to_it_with_and_without_special_tokens(
    tokenizer, skip_special_tokens
):
    special = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompt = ids("> ")
    # a special token, then text with the stop string, then more text in the same round
    new = [special, special, *ids("abSTOP"), *ids("cdefgh")]
    req = _request(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
    commit_tokens(req, ids("x"), tokenizer=tokenizer, first=True)  # the token after the prompt
    finish, stop_reason, kept, _ = commit_tokens(req, new, tokenizer=tokenizer)
    assert (finish, stop_reason) == ("stop", "STOP")
    shown = "" if skip_special_tokens else "<|endoftext|>" * 2
    assert req.text == "x" + shown + "ab"
    # every token up to the stop string's last one, none after it (the special tokens count as the
    # request shows them: with skip_special_tokens=False they are text that comes before the stop)
    assert kept == new[: 2 + len(ids("abSTOP"))]
    assert tokenizer.decode(req.output_ids, skip_special_tokens=skip_special_tokens).endswith("abSTOP")
