# SPDX-License-Identifier: Apache-2.0
"""Workloads: exact input token counts (plain and chat-templated), JSONL prompts, determinism."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from dflash_trt.bench.workload import PromptSource, WorkloadSpec, load_tokenizer
from dflash_trt.errors import UsageError

CHAT = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"


@pytest.fixture(scope="module")
def bpe_tokenizer() -> Any:
    """A real byte-level BPE with merges and a BOS post-processor, trained offline in milliseconds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    words = [
        "speculative",
        "decoding",
        "draft",
        "target",
        "token",
        "block",
        "accept",
        "the",
        "a",
        "of",
        "é",
        "naïve",
        "数据",
    ]
    corpus = [" ".join(rng.choice(words) for _ in range(30)) for _ in range(200)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", additional_special_tokens=["<|im_start|>", "<|im_end|>"]
    )
    fast.chat_template = CHAT
    return fast


@pytest.mark.parametrize("isl", [2, 7, 64, 333, 2048])
def test_synthetic_prompts_have_exact_token_counts(bpe_tokenizer, isl) -> None:
    src = PromptSource(WorkloadSpec(isl=isl, osl=8, seed=1), bpe_tokenizer, protocol="triton-grpc")
    for i in range(5):
        p = src.get(i, stream="s")
        ids = bpe_tokenizer(p.text)["input_ids"]
        assert len(ids) == isl == p.input_tokens  # the BOS the server adds is counted
        assert ids[0] == bpe_tokenizer.bos_token_id
        assert p.output_tokens == 8 and p.messages is None


@pytest.mark.parametrize("protocol", ["triton-http", "openai-chat"])
def test_chat_templated_prompts_have_exact_token_counts(bpe_tokenizer, protocol) -> None:
    spec = WorkloadSpec(isl=150, osl=8, chat=True, seed=2)
    src = PromptSource(spec, bpe_tokenizer, protocol=protocol)
    p = src.get(0)
    assert (
        p.text is not None
        and p.text.startswith("<|im_start|>user\n")
        and p.text.endswith("<|im_start|>assistant\n")
    )
    assert len(bpe_tokenizer(p.text, add_special_tokens=False)["input_ids"]) == 150 == p.input_tokens
    if protocol == "openai-chat":
        assert (
            p.messages is not None and p.messages[0]["role"] == "user" and p.messages[0]["content"] in p.text
        )
    with pytest.raises(UsageError, match="the prompt template alone takes"):
        PromptSource(WorkloadSpec(isl=3, osl=8, chat=True), bpe_tokenizer, protocol=protocol).get(0)


def test_range_ratio_and_determinism(bpe_tokenizer) -> None:
    spec = WorkloadSpec(isl=100, osl=50, range_ratio=0.8, seed=3)
    a = PromptSource(spec, bpe_tokenizer, protocol="triton-grpc")
    b = PromptSource(spec, bpe_tokenizer, protocol="triton-grpc")
    prompts = [a.get(i, stream="c=4") for i in range(20)]
    assert all(80 <= p.input_tokens <= 100 and 40 <= p.output_tokens <= 50 for p in prompts)  # type: ignore[operator]
    assert len({p.input_tokens for p in prompts}) > 3
    assert all(len(bpe_tokenizer(p.text)["input_ids"]) == p.input_tokens for p in prompts)
    assert [b.get(i, stream="c=4").text for i in range(20)] == [
        p.text for p in prompts
    ]  # same seed, same prompts
    assert a.get(0, stream="c=4/warmup").text != prompts[0].text  # streams differ
    other = PromptSource(
        WorkloadSpec(isl=100, osl=50, range_ratio=0.8, seed=4), bpe_tokenizer, protocol="triton-grpc"
    )
    assert other.get(0, stream="c=4").text != prompts[0].text


def test_jsonl_prompts(tmp_path: Path, bpe_tokenizer) -> None:
    path = tmp_path / "p.jsonl"
    rows = [
        {"prompt": "the draft token", "output_tokens": 12},
        {"text": "block accept"},
        {"messages": [{"role": "user", "content": "naïve target"}], "max_tokens": 7},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    src = PromptSource(WorkloadSpec(dataset=str(path), osl=None), bpe_tokenizer, protocol="triton-http")
    p0 = src.get(0)
    assert p0.text == "the draft token" and p0.output_tokens == 12
    assert p0.input_tokens == len(bpe_tokenizer("the draft token")["input_ids"])
    with pytest.raises(UsageError, match="line 2 has no output_tokens and --osl is not set"):
        src.get(1)
    p2 = src.get(2)
    assert (
        p2.text is not None and p2.text.startswith("<|im_start|>user\nnaïve target") and p2.output_tokens == 7
    )
    # --osl overrides; chat wraps plain prompts; openai-chat sends messages
    src = PromptSource(
        WorkloadSpec(dataset=str(path), osl=5, chat=True), bpe_tokenizer, protocol="openai-chat"
    )
    p1 = src.get(1)
    assert p1.output_tokens == 5 and p1.messages == ({"role": "user", "content": "block accept"},)
    # no tokenizer: prompts still go out, the client cannot count them
    src = PromptSource(WorkloadSpec(dataset=str(path), osl=5), None, protocol="openai-chat")
    assert src.get(2).input_tokens is None and src.get(2).messages is not None
    # streams start at different offsets, deterministically
    src = PromptSource(WorkloadSpec(dataset=str(path), osl=5), bpe_tokenizer, protocol="triton-http")
    assert [src.get(i, stream="x").text for i in range(3)] == [src.get(i, stream="x").text for i in range(3)]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"prompt": "a"}\nnot json\n', "line 2 is not JSON"),
        ('{"nothing": 1}\n', "line 1 has neither a string `prompt`/`text` nor a `messages` list"),
        ("\n\n", "the file holds no prompts"),
    ],
)
def test_jsonl_errors(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(UsageError, match=message):
        PromptSource(WorkloadSpec(dataset=str(path), osl=4), None, protocol="triton-http")
    with pytest.raises(UsageError, match="no such file"):
        PromptSource(
            WorkloadSpec(dataset=str(tmp_path / "missing.jsonl"), osl=4), None, protocol="triton-http"
        )


def test_tokenizer_errors(byte_tokenizer, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="needs a tokenizer with a chat template"):
        PromptSource(WorkloadSpec(isl=10, osl=4, chat=True), byte_tokenizer, protocol="triton-http")
    with pytest.raises(UsageError, match="synthetic prompts"):
        PromptSource(WorkloadSpec(isl=10, osl=4), None, protocol="triton-http")
    with pytest.raises(UsageError, match="--tokenizer="):
        load_tokenizer(str(tmp_path / "missing"))


@pytest.mark.parametrize("protocol", ["triton-http", "openai-chat"])
def test_a_shared_system_prompt_leads_every_prompt_of_exact_length(bpe_tokenizer, protocol) -> None:
    """--system-prompt-tokens: the same system message heads every chat; the whole templated prompt is
    still exactly ISL tokens."""
    src = PromptSource(WorkloadSpec(isl=400, osl=8, chat=True, seed=3, system_prompt_tokens=200), bpe_tokenizer,
                       protocol=protocol)  # fmt: skip
    prompts = [src.get(i, stream="s") for i in range(3)]
    system = prompts[0].text.split("<|im_start|>user")[0]
    assert system.startswith("<|im_start|>system\n") and len(bpe_tokenizer(system)["input_ids"]) > 150
    for p in prompts:
        assert p.text.startswith(system) and p.input_tokens == 400
        assert len(bpe_tokenizer(p.text, add_special_tokens=False)["input_ids"]) == 400
        if protocol == "openai-chat":
            assert p.messages[0] == {"role": "system", "content": prompts[0].messages[0]["content"]}
    assert len({p.text for p in prompts}) == 3


def test_multi_turn_chats_resend_their_history(bpe_tokenizer) -> None:
    """--turns 3: turn k of a conversation is turn k-1's messages, a synthetic assistant reply and a new
    user message; conversations differ from each other."""
    src = PromptSource(WorkloadSpec(isl=30, osl=12, seed=4, turns=3, system_prompt_tokens=40), bpe_tokenizer,
                       protocol="openai-chat")  # fmt: skip
    conv = [src.get(i, stream="s") for i in range(6)]
    for k in (1, 2):
        prev, cur = conv[k - 1].messages, conv[k].messages
        assert cur[: len(prev)] == prev and [m["role"] for m in cur[len(prev) :]] == ["assistant", "user"]
        assert cur[0]["role"] == "system" and conv[k].input_tokens > conv[k - 1].input_tokens
        assert conv[k].text.startswith(conv[k - 1].text.removesuffix("<|im_start|>assistant\n"))
    assert (
        conv[3].messages[:2] == conv[0].messages[:1] + conv[3].messages[1:2]
        and conv[3].messages[1] != conv[0].messages[1]
    )
    assert [len(p.messages) for p in conv] == [2, 4, 6, 2, 4, 6]


def test_the_closed_loop_sends_a_conversations_turns_in_order() -> None:
    """With turns, a worker takes whole conversations: turn k is sent only after turn k-1 ended, while
    other conversations run beside it; a partial last conversation is completed."""
    import asyncio

    from dflash_trt.bench.sweep import _closed_loop

    events: list[tuple[str, int]] = []

    class Client:
        async def send(self, payload: int, raw) -> None:
            events.append(("start", payload))
            await asyncio.sleep(0.001 * (payload % 3))
            events.append(("end", payload))

    done = asyncio.run(_closed_loop(Client(), list(range(9)), concurrency=2, num_requests=7, duration_s=None,
                                    on_done=lambda r: None, turns=3))  # fmt: skip
    assert sorted(r.index for r in done) == list(range(9))  # 7 requests round up to 3 conversations
    for i in range(9):
        if i % 3:
            assert events.index(("end", i - 1)) < events.index(("start", i))
    assert events.index(("start", 3)) < events.index(("end", 2))  # two conversations at once
