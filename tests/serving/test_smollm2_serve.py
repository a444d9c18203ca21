# SPDX-License-Identifier: Apache-2.0
"""The real pair served as a user brings it: `dflash-trt build --target smollm2-135m --drafter
smollm2-135m-dflash` (its packaged DFlash drafter), a real `dflash-trt serve` with the OpenAI front, and the official OpenAI client's chat
completions. The front renders SmolLM2's own chat template, generation ends at its end-of-turn token
`<|im_end|>` (finish_reason "stop"), and the greedy answer equals `dflash-trt generate --chat --json`'s,
streamed or not, with drafts accepted."""

from __future__ import annotations

import contextlib
import io
import json
import signal

import openai
import pytest

from tests.serving.conftest import build_bundle, launch_serve

pytestmark = [pytest.mark.triton_server, pytest.mark.slow]

DRAFTER = "smollm2-135m-dflash"
QUESTION = "What is the capital of France? Answer in one sentence."
MAX_TOKENS = 96


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    bundle = build_bundle(tmp_path_factory.mktemp("bundles") / "smollm2", "--target", "smollm2-135m",
                          "--drafter", DRAFTER)  # fmt: skip
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["target"]["model_type"] == "llama" and manifest["drafter"]["mask_token_id"] == 16
    proc, ports = launch_serve(bundle, openai=True, timeout=240)
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{ports['openai']}/v1", api_key="none", max_retries=0)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err


@pytest.fixture(scope="module")
def reference() -> dict:
    from dflash_trt.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        main(["generate", "--target", "smollm2-135m", "--drafter", DRAFTER, "--chat", "--prompt", QUESTION,
              "--max-new-tokens", str(MAX_TOKENS), "--json"])  # fmt: skip
    assert exit_info.value.code == 0
    return json.loads(out.getvalue())


def test_chat_answers_with_the_models_template_and_stops_at_end_of_turn(served, reference) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    resp = served.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=MAX_TOKENS,
                                          temperature=0)  # fmt: skip
    choice = resp.choices[0]
    assert choice.finish_reason == "stop" and reference["output_ids"][-1] == 2  # <|im_end|>
    assert choice.message.content == reference["text"] and "Paris" in choice.message.content
    assert "<|im_" not in choice.message.content  # special tokens never reach the client
    assert resp.usage.completion_tokens == len(reference["output_ids"])
    dflash = resp.model_extra["dflash"]  # every token after the prefill's came from a verified round
    assert round(dflash["mean_acceptance_length"] * dflash["num_rounds"]) == resp.usage.completion_tokens - 1
    chunks = served.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True)  # fmt: skip
    streamed = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(streamed) == reference["text"]
